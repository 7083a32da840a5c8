"""`/healthz` (the process is alive: its loop has not died) and `/readyz` (it can do its work now: Redis,
the model or engine, a loop that is not retrying transient trouble)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from pydantic import BaseModel
from redis.exceptions import RedisError

from offpolicy.config.secrets import redact_url
from offpolicy.services.common.errors import LoopFailed, NotReady, error_responses

ReadinessCheck = Callable[[], Awaitable[str | None]]
"""An async check: None when the dependency is ready, else one sentence saying why not."""


class HealthResponse(BaseModel):
    """Liveness: the process serves HTTP and its loop (if it hosts one) has not died."""

    status: str = "ok"


class ReadyResponse(BaseModel):
    """Readiness: every named check passed."""

    status: str = "ready"
    checks: dict[str, str]
    """Check name -> `ok`."""


router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthResponse, summary="Liveness", responses=error_responses(503))
async def healthz(request: Request) -> HealthResponse:
    liveness: Callable[[], str | None] | None = request.app.state.liveness
    reason = liveness() if liveness is not None else None
    if reason is not None:
        exit_in_s = request.app.state.fatal_exit.exit_in_s()
        raise LoopFailed(reason, detail={"reason": reason, "exit_in_s": exit_in_s})
    return HealthResponse()


@router.get("/readyz", response_model=ReadyResponse, summary="Readiness", responses=error_responses(503))
async def readyz(request: Request) -> ReadyResponse:
    checks: dict[str, ReadinessCheck] = request.app.state.readiness_checks
    reasons = await asyncio.gather(*(check() for check in checks.values()))
    results = {name: reason or "ok" for name, reason in zip(checks, reasons, strict=True)}
    if any(reasons):
        raise NotReady("not ready: " + "; ".join(r for r in reasons if r), detail={"checks": results})
    return ReadyResponse(checks=results)


def redis_check(url: str, timeout_s: float) -> ReadinessCheck:
    """A check that PINGs the Redis at `url` with a `timeout_s` bound."""

    async def check() -> str | None:
        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            await client.ping()
        except (RedisError, OSError) as exc:
            return f"redis at {redact_url(url)} unreachable: {type(exc).__name__}"
        finally:
            await client.aclose()
        return None

    return check
