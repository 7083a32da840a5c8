"""The app factory every service shares: error envelope, health, metrics, a hosted runtime, uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry

from offpolicy.config.secrets import Redactor
from offpolicy.services.common import health, metrics
from offpolicy.services.common.background import ExitAfterGrace, FailureHook
from offpolicy.services.common.errors import install_error_handlers
from offpolicy.services.common.health import ReadinessCheck, redis_check
from offpolicy.services.common.limits import BodySizeLimit
from offpolicy.services.common.logging import configure_logging
from offpolicy.services.common.settings import ServiceSettings

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
S = TypeVar("S", bound=ServiceSettings)


class ServiceRuntime(Protocol):
    """What the shared app needs of a service's domain side (`LearnerRuntime`, `ActorRuntime`)."""

    def start(self, on_failure: FailureHook) -> None: ...
    def stop(self) -> None: ...
    def readiness(self) -> str | None: ...
    def liveness(self) -> str | None: ...


def create_service_app(
    *,
    title: str,
    description: str,
    settings: ServiceSettings,
    registry: CollectorRegistry,
    readiness_checks: dict[str, ReadinessCheck],
    lifespan: Lifespan | None = None,
    redactor: Redactor | None = None,
) -> FastAPI:
    """A FastAPI app with `/healthz`, `/readyz` (running `readiness_checks`), `/metrics` on `registry`,
    the error envelope, the body size limit, and `settings`, `registry`, `readiness_checks`, `redactor`
    (the secrets no response or log line may show: the API and gateway tokens plus those of `redactor`)
    on `app.state`;
    `liveness` (None: `/healthz` always 200) and `fatal_exit` (None: nothing to exit for) are set by
    `create_runtime_app`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        app_version = version("offpolicy")
    except PackageNotFoundError:  # running from a checkout that was never pip-installed
        app_version = "0.0.0"
    app = FastAPI(title=title, description=description, version=app_version, lifespan=lifespan)
    app.state.settings = settings
    app.state.registry = registry
    app.state.readiness_checks = readiness_checks
    app.state.liveness = None
    app.state.fatal_exit = None
    app.state.redactor = redactor or Redactor()
    for token in (settings.api_token, getattr(settings, "gateway_token", None)):
        if token is not None:
            app.state.redactor.add(token.get_secret_value())
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.include_router(health.router)
    app.include_router(metrics.router)
    return app


def create_runtime_app(
    *,
    title: str,
    description: str,
    settings: ServiceSettings,
    registry: CollectorRegistry,
    runtime: ServiceRuntime,
    component: str,
    redis_url: str,
    router: APIRouter,
    redactor: Redactor,
) -> FastAPI:
    """`create_service_app` hosting `runtime`: the lifespan starts and stops it, `/readyz` checks `redis`
    (PING `redis_url`) and `component` (`runtime.readiness()`), `/healthz` answers 503 once the runtime's
    loop died (`runtime.liveness()`), after which the process exits non-zero in
    `settings.fatal_exit_grace_s` (`ExitAfterGrace`, armed by `serve_app`); `app.state.runtime` holds the
    runtime, and `router` (the service's `/v1` routes) is mounted. `redactor` knows `redis_url`'s password
    (the runtime's own)."""
    fatal_exit = ExitAfterGrace(settings.fatal_exit_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start(fatal_exit)
        try:
            yield
        finally:
            runtime.stop()

    async def runtime_ready() -> str | None:
        return runtime.readiness()

    app = create_service_app(
        title=title,
        description=description,
        settings=settings,
        registry=registry,
        readiness_checks={
            "redis": redis_check(redis_url, settings.redis_ping_timeout_s),
            component: runtime_ready,
        },
        lifespan=lifespan,
        redactor=redactor,
    )
    app.state.runtime = runtime
    app.state.liveness = runtime.liveness
    app.state.fatal_exit = fatal_exit
    app.include_router(router)
    return app


def serve_app(settings: S, create_app: Callable[[S], FastAPI]) -> int:
    """Build the app, configure logging from `settings` (scrubbing the app's secrets from every line) and
    run it under uvicorn until SIGTERM / Ctrl-C, or until a hosted loop died and its grace ran out.

    The listening socket is bound first, before the app is built and its runtime started (an actor's vLLM
    engine takes tens of seconds): uvicorn binds only after the lifespan's startup, and a port chosen free
    by whoever started this process could meanwhile go to another socket (an engine's own ports, another
    service's connections), which ended the service with "address already in use".

    Returns the process exit status: 0 after a requested stop, `EXIT_LOOP_FAILED` after a dead loop."""
    configure_logging(settings.log_level, settings.log_json)
    sock = uvicorn.Config(None, host=settings.host, port=settings.port, log_config=None).bind_socket()
    app = create_app(settings)
    configure_logging(settings.log_level, settings.log_json, app.state.redactor)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on")
    )
    status = 0

    def request_exit(code: int) -> None:
        nonlocal status
        status = code
        server.should_exit = True  # uvicorn's graceful stop: the lifespan stops the runtime

    if app.state.fatal_exit is not None:
        app.state.fatal_exit.request_exit = request_exit
    server.run(sockets=[sock])
    return status
