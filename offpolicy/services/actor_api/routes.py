"""The actor's `/v1` routes: its status, its runs (`/v1/runs`: an actor pool's, actors/rollout/pool.py), and
the OpenAI-compatible gateway when `gateway.enabled` (`/v1/episodes`, `/v1/chat/completions`:
actors/gateway/agent_episodes.py, docs/agents.md). Health, readiness and metrics come from services/common."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Path, Request
from fastapi.responses import JSONResponse

from offpolicy.config.base import MAX_ID, RUN_ID_PATTERN
from offpolicy.services.actor_api.runtime import ActorRuntime
from offpolicy.services.actor_api.schemas import (
    ActorStatus,
    EpisodeFinished,
    EpisodeOpened,
    FinishEpisode,
    OpenEpisode,
    RunList,
    RunStatus,
)
from offpolicy.services.common.auth import Authorized, GatewayAuthorized
from offpolicy.services.common.errors import InvalidConfig, error_responses

EPISODE_ID = Path(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")
RUN_ID = Path(
    min_length=1, max_length=MAX_ID, pattern=RUN_ID_PATTERN, description="The run's id (its `run_id`)"
)
_RUN_BODY = Annotated[
    dict[str, Any],
    Body(
        description="A run's `ActorConfig` (fields left out take their defaults; `model_path` and `engine` "
        "are the pool's, and may be left out)."
    ),
]
_PATCH_BODY = Annotated[
    dict[str, Any],
    Body(description="Keys to merge into the run's config: `max_inflight_prompts`, `sampling`."),
]


def get_runtime(request: Request) -> ActorRuntime:
    return request.app.state.runtime


Runtime = Annotated[ActorRuntime, Depends(get_runtime)]
router = APIRouter(prefix="/v1")


@router.get("/status", response_model=ActorStatus, tags=["status"], summary="What the actor is doing")
def status(runtime: Runtime) -> ActorStatus:
    return runtime.status()


@router.get("/runs", response_model=RunList, tags=["runs"], summary="The runs this actor serves")
def list_runs(runtime: Runtime) -> RunList:
    return runtime.runs()


@router.post(
    "/runs",
    response_model=RunStatus,
    status_code=201,
    dependencies=[Authorized],
    tags=["runs"],
    summary="Add a run to the actor's engine (its own adapters, dataset, reward, buffer)",
    responses=error_responses(401, 409, 413, 422, 503),
)
def add_run(runtime: Runtime, body: _RUN_BODY) -> RunStatus:
    return runtime.add_run(body)


@router.patch(
    "/runs/{run_id}",
    response_model=RunStatus,
    dependencies=[Authorized],
    tags=["runs"],
    summary="Change a run's share (max_inflight_prompts) or sampling, from its next admission",
    responses=error_responses(401, 404, 409, 413, 422, 503),
)
def update_run(runtime: Runtime, run_id: Annotated[str, RUN_ID], body: _PATCH_BODY) -> RunStatus:
    return runtime.update_run(run_id, body)


@router.delete(
    "/runs/{run_id}",
    response_model=RunStatus,
    dependencies=[Authorized],
    tags=["runs"],
    summary="Stop a run and release its adapters (its buffer keeps its groups)",
    responses=error_responses(401, 404, 503),
)
def remove_run(runtime: Runtime, run_id: Annotated[str, RUN_ID]) -> RunStatus:
    return runtime.remove_run(run_id)


@router.post(
    "/episodes",
    response_model=EpisodeOpened,
    dependencies=[GatewayAuthorized],
    tags=["gateway"],
    summary="Open an episode (its chat calls carry X-Episode-Id)",
    responses=error_responses(401, 404, 409, 422, 429, 503),
)
async def open_episode(body: OpenEpisode, runtime: Runtime) -> EpisodeOpened:
    gateway = runtime.gateway(body.run_id)
    opened = await runtime.on_engine(
        gateway.open_episode(body.prompt_id, body.group_id, body.group_size, body.answer, body.metadata)
    )
    return EpisodeOpened(**opened)


@router.post(
    "/episodes/{episode_id}/finish",
    response_model=EpisodeFinished,
    dependencies=[GatewayAuthorized],
    tags=["gateway"],
    summary="Close an episode with its reward (none: the reward function scores it)",
    responses=error_responses(401, 404, 422, 503),
)
async def finish_episode(
    runtime: Runtime,
    episode_id: Annotated[str, EPISODE_ID],
    body: FinishEpisode | None = None,
) -> EpisodeFinished:
    body = body or FinishEpisode()
    gateway = runtime.gateway_of(episode_id)
    done = await runtime.on_engine(gateway.finish(episode_id, body.reward, body.metadata))
    return EpisodeFinished(**done)


@router.post(
    "/chat/completions",
    dependencies=[GatewayAuthorized],
    tags=["gateway"],
    summary="An OpenAI chat completion; recorded within the episode named by X-Episode-Id",
    responses=error_responses(401, 404, 409, 422, 503),
)
async def chat_completions(
    request: Request,
    runtime: Runtime,
    x_episode_id: Annotated[str | None, Header(max_length=64, pattern=r"^[0-9a-f]+$")] = None,
) -> JSONResponse:
    t0 = time.perf_counter()
    try:
        body: Any = await request.json()
    except ValueError as e:
        raise InvalidConfig(
            "the body is not JSON", [{"field": "body", "message": str(e), "type": "json"}]
        ) from e
    if not isinstance(body, dict):
        raise InvalidConfig(
            "the body must be an object", [{"field": "body", "message": "not an object", "type": "type"}]
        )
    gateway = runtime.gateway_of(x_episode_id)
    response = JSONResponse(await runtime.on_engine(gateway.chat(x_episode_id, body)))
    gateway.metrics.gateway_seconds.labels("request").inc(time.perf_counter() - t0)  # parse to response
    return response
