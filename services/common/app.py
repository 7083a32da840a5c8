"""The app factory every service shares: settings, registry, error envelope, health and metrics routes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from services.common import health, metrics
from services.common.errors import install_error_handlers
from services.common.health import ReadinessCheck
from services.common.settings import ServiceSettings

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_service_app(
    *,
    title: str,
    description: str,
    settings: ServiceSettings,
    registry: CollectorRegistry,
    readiness_checks: dict[str, ReadinessCheck],
    lifespan: Lifespan | None = None,
) -> FastAPI:
    """A FastAPI app with `/healthz`, `/readyz` (running `readiness_checks`), `/metrics` on `registry`,
    the error envelope, and `settings`, `registry`, `readiness_checks` on `app.state`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        app_version = version("offpolicy")
    except PackageNotFoundError:  # running from a checkout that was never pip-installed
        app_version = "0.0.0"
    app = FastAPI(title=title, description=description, version=app_version, lifespan=lifespan)
    app.state.settings = settings
    app.state.registry = registry
    app.state.readiness_checks = readiness_checks
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    return app
