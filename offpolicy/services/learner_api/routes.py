"""The learner's `/v1` routes: parse, call one runtime or control method, return. No logic here.

Every config a route returns passes through `control.redacted` (the Redis password masked)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel

from offpolicy.services.common.auth import Authorized
from offpolicy.services.common.errors import error_responses
from offpolicy.services.learner_api.control import redacted, redacted_config, with_changes
from offpolicy.services.learner_api.deps import Control, Runtime
from offpolicy.services.learner_api.schemas import (
    CheckpointResult,
    ConfigChange,
    ConfigEntry,
    ConfigHistory,
    ConfigPatch,
    ConfigValidation,
    DeadLetterList,
    GroupsIngest,
    IngestResult,
    LearnerStatus,
    Preset,
    PresetList,
)

router = APIRouter(prefix="/v1")
RouteFn = TypeVar("RouteFn", bound=Callable[..., Any])
_CHANGE_ERRORS = (401, 409, 413, 422, 503)

_PUT_BODY = Annotated[
    dict[str, Any],
    Body(description="A complete `LearnerConfig` (fields left out take their defaults)."),
]
_MODE = Annotated[Literal["replace", "merge"], Query(description="replace = PUT, merge = PATCH")]
_PUT_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LearnerConfig"}}},
    }
}


def _mutating(
    method: Literal["PUT", "PATCH", "POST"],
    path: str,
    response_model: type[BaseModel],
    tag: str,
    summary: str,
    *,
    errors: tuple[int, ...],
    status_code: int | None = None,
    openapi_extra: dict[str, Any] | None = None,
) -> Callable[[RouteFn], RouteFn]:
    """The decorator of a route that changes the learner: bearer token required (`Authorized`), its error
    statuses documented from the one table, one tag."""
    return router.api_route(
        path,
        methods=[method],
        response_model=response_model,
        status_code=status_code,
        tags=[tag],
        summary=summary,
        dependencies=[Authorized],
        responses=error_responses(*errors),
        openapi_extra=openapi_extra,
    )


@router.get("/config", response_model=ConfigEntry, tags=["config"], summary="The running config")
def get_config(control: Control) -> ConfigEntry:
    return redacted(control.running())


@_mutating(
    "PUT",
    "/config",
    ConfigChange,
    "config",
    "Replace the config (applied at the next step boundary)",
    errors=_CHANGE_ERRORS,
    status_code=202,
    openapi_extra=_PUT_SCHEMA,
)
def put_config(control: Control, body: _PUT_BODY) -> ConfigChange:
    return _change(control.submit(body, "replace", "put"))


@_mutating(
    "PATCH",
    "/config",
    ConfigChange,
    "config",
    "Merge into the config (applied at the next step boundary)",
    errors=_CHANGE_ERRORS,
    status_code=202,
)
def patch_config(control: Control, body: ConfigPatch) -> ConfigChange:
    return _change(control.submit(body.model_extra or {}, "merge", "patch"))


@router.post(
    "/config/validate",
    response_model=ConfigValidation,
    tags=["config"],
    summary="Dry run of PUT (mode=replace) or PATCH (mode=merge): same checks, nothing applied",
    responses=error_responses(409, 413, 422),
    openapi_extra=_PUT_SCHEMA,
)
def validate_config(
    control: Control,
    body: _PUT_BODY,
    mode: _MODE = "replace",
) -> ConfigValidation:
    config, changed = control.resolve(body, mode)
    return ConfigValidation(changed_fields=changed, config=redacted_config(config))


@router.get("/config/history", response_model=ConfigHistory, tags=["config"], summary="Every config version")
def config_history(control: Control, runtime: Runtime) -> ConfigHistory:
    return ConfigHistory(entries=with_changes(control.history()), control=runtime.control_history())


@router.get("/presets", response_model=PresetList, tags=["presets"], summary="Rollout-correction presets")
def list_presets(runtime: Runtime) -> PresetList:
    return PresetList(presets=runtime.presets())


@router.get(
    "/presets/{name}",
    response_model=Preset,
    tags=["presets"],
    summary="One preset by canonical name or seed-era alias",
    responses=error_responses(404),
)
def get_preset(runtime: Runtime, name: str) -> Preset:
    return runtime.preset(name)


@router.get("/status", response_model=LearnerStatus, tags=["control"], summary="What the learner is doing")
def status(runtime: Runtime) -> LearnerStatus:
    return runtime.status()


@router.get(
    "/dead_letters",
    response_model=DeadLetterList,
    tags=["buffer"],
    summary="Groups set aside as poison (newest first)",
    responses=error_responses(503),
)
def dead_letters(
    runtime: Runtime, limit: Annotated[int, Query(ge=1, le=1000, description="most entries")] = 100
) -> DeadLetterList:
    return runtime.dead_letters(limit)


@_mutating("POST", "/pause", LearnerStatus, "control", "Pause at the next step boundary", errors=(401, 503))
def pause(runtime: Runtime) -> LearnerStatus:
    return runtime.pause()


@_mutating("POST", "/resume", LearnerStatus, "control", "Resume a paused learner", errors=(401, 503))
def resume(runtime: Runtime) -> LearnerStatus:
    return runtime.resume()


@_mutating(
    "POST",
    "/checkpoints",
    CheckpointResult,
    "control",
    "Write a checkpoint now",
    errors=(401, 409, 503),
    status_code=201,
)
def checkpoint(runtime: Runtime) -> CheckpointResult:
    return runtime.checkpoint()


@_mutating(
    "POST",
    "/groups",
    IngestResult,
    "buffer",
    "Insert groups generated elsewhere",
    errors=(401, 413, 422, 429, 503),
)
def ingest(runtime: Runtime, body: GroupsIngest) -> IngestResult:
    return runtime.ingest(body.groups)


def _change(entry: ConfigEntry) -> ConfigChange:
    entry = redacted(entry)
    return ConfigChange(
        config_version=entry.config_version,
        status="applied" if entry.applied_at is not None else "pending",
        changed_fields=entry.changed_fields,
        config=entry.config,
    )
