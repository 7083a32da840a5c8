"""The actor service: `create_app(settings)` builds the FastAPI app; `serve()` runs it under uvicorn."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from services.actor_api import routes
from services.actor_api.runtime import ActorFactory, ActorRuntime
from services.common.app import create_service_app
from services.common.health import redis_check
from services.common.logging import configure_logging
from services.common.metrics import make_registry
from services.common.settings import ActorServiceSettings

DESCRIPTION = """An offpolicy actor: vLLM generation into the replay buffer, reloading published weights.

Serves liveness, readiness (Redis reachable, engine loaded, loop running), Prometheus metrics and its
status; it has no mutating routes.
"""


def _default_factory(config: Any, registry: Any):
    from actors.worker import Actor

    return Actor(config, registry)


def create_app(
    settings: ActorServiceSettings | None = None,
    *,
    config: Any = None,
    actor_factory: ActorFactory | None = None,
) -> FastAPI:
    """The actor app; `config` defaults to `settings.config_path` (+ `OFFPOLICY_*` overrides)."""
    settings = settings or ActorServiceSettings()
    if config is None:
        from actors.config import load_config

        config = load_config(settings.config_path, os.environ)
    registry = make_registry()
    runtime = ActorRuntime(config, registry, actor_factory or _default_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start()
        try:
            yield
        finally:
            runtime.stop()

    async def actor_ready() -> str | None:
        return runtime.readiness()

    app = create_service_app(
        title="offpolicy actor",
        description=DESCRIPTION,
        settings=settings,
        registry=registry,
        readiness_checks={
            "redis": redis_check(config.redis_url, settings.redis_ping_timeout_s),
            "actor": actor_ready,
        },
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.include_router(routes.router)
    return app


def serve(**overrides: Any) -> int:
    """Run the actor service in this process until SIGTERM / Ctrl-C; settings from env + `overrides`."""
    settings = ActorServiceSettings(**overrides)
    configure_logging(settings.log_level, settings.log_json)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on")
    )
    server.run()
    return 0
