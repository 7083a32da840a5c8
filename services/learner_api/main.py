"""The learner service: `create_app(settings)` builds the FastAPI app; `serve()` runs it under uvicorn."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from learner.config import LearnerConfig, load_config
from services.common.app import create_service_app
from services.common.health import redis_check
from services.common.logging import configure_logging
from services.common.metrics import make_registry
from services.common.settings import LearnerServiceSettings
from services.learner_api import routes
from services.learner_api.runtime import ConfigApplied, LearnerFactory, LearnerRuntime

DESCRIPTION = """Control plane of the offpolicy learner.

Config changes (PUT replaces, PATCH merges) are validated, refused with 409 when they touch a field that
cannot change while running (the model, the Redis run, the weights folder), and applied at the next step
boundary with a new `config_version`. Mutating routes need `Authorization: Bearer <token>` when the
service runs with `OFFPOLICY_API_TOKEN`. Errors are `{"error": {"code", "message", "detail"}}`.
"""


def _default_factory(config: LearnerConfig, registry: Any, on_config_applied: ConfigApplied):
    from learner.train import Learner

    return Learner(config, registry, on_config_applied)


def create_app(
    settings: LearnerServiceSettings | None = None,
    *,
    config: LearnerConfig | None = None,
    learner_factory: LearnerFactory | None = None,
) -> FastAPI:
    """The learner app; `config` defaults to `settings.config_path` (+ `OFFPOLICY_*` overrides)."""
    settings = settings or LearnerServiceSettings()
    if config is None:
        config = load_config(settings.config_path, os.environ)
    registry = make_registry()
    runtime = LearnerRuntime(config, registry, learner_factory or _default_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start()
        try:
            yield
        finally:
            runtime.stop()

    async def learner_ready() -> str | None:
        return runtime.readiness()

    app = create_service_app(
        title="offpolicy learner",
        description=DESCRIPTION,
        settings=settings,
        registry=registry,
        readiness_checks={
            "redis": redis_check(config.redis_url, settings.redis_ping_timeout_s),
            "learner": learner_ready,
        },
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.include_router(routes.router)
    return app


def serve(**overrides: Any) -> int:
    """Run the learner service in this process until SIGTERM / Ctrl-C; settings from env + `overrides`."""
    settings = LearnerServiceSettings(**overrides)
    configure_logging(settings.log_level, settings.log_json)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on")
    )
    server.run()
    return 0
