"""The actor's `/v1` route: its status. Health, readiness and metrics come from services/common."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from services.actor_api.runtime import ActorRuntime
from services.actor_api.schemas import ActorStatus


def get_runtime(request: Request) -> ActorRuntime:
    return request.app.state.runtime


Runtime = Annotated[ActorRuntime, Depends(get_runtime)]
router = APIRouter(prefix="/v1")


@router.get("/status", response_model=ActorStatus, tags=["status"], summary="What the actor is doing")
def status(runtime: Runtime) -> ActorStatus:
    return runtime.status()
