"""The learner's `/v1` routes: parse, call one runtime or control method, return. No logic here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query

from services.common.auth import Authorized
from services.common.errors import error_responses
from services.learner_api.deps import Control, Runtime
from services.learner_api.schemas import (
    CheckpointResult,
    ConfigChange,
    ConfigEntry,
    ConfigHistory,
    ConfigPatch,
    ConfigValidation,
    LearnerStatus,
    Preset,
    PresetList,
)

router = APIRouter(prefix="/v1")
_CHANGE_ERRORS = error_responses(401, 409, 422, 503)

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


@router.get("/config", response_model=ConfigEntry, tags=["config"], summary="The running config")
def get_config(control: Control) -> ConfigEntry:
    return control.running()


@router.put(
    "/config",
    response_model=ConfigChange,
    status_code=202,
    tags=["config"],
    summary="Replace the config (applied at the next step boundary)",
    dependencies=[Authorized],
    responses=_CHANGE_ERRORS,
    openapi_extra=_PUT_SCHEMA,
)
def put_config(control: Control, body: _PUT_BODY) -> ConfigChange:
    return _change(control.submit(body, "replace", "put"))


@router.patch(
    "/config",
    response_model=ConfigChange,
    status_code=202,
    tags=["config"],
    summary="Merge into the config (applied at the next step boundary)",
    dependencies=[Authorized],
    responses=_CHANGE_ERRORS,
)
def patch_config(control: Control, body: ConfigPatch) -> ConfigChange:
    return _change(control.submit(body.model_extra or {}, "merge", "patch"))


@router.post(
    "/config/validate",
    response_model=ConfigValidation,
    tags=["config"],
    summary="Dry run of PUT (mode=replace) or PATCH (mode=merge): same checks, nothing applied",
    responses=error_responses(409, 422),
    openapi_extra=_PUT_SCHEMA,
)
def validate_config(
    control: Control,
    body: _PUT_BODY,
    mode: _MODE = "replace",
) -> ConfigValidation:
    config, changed = control.resolve(body, mode)
    return ConfigValidation(changed_fields=changed, config=config)


@router.get("/config/history", response_model=ConfigHistory, tags=["config"], summary="Every config version")
def config_history(control: Control) -> ConfigHistory:
    return ConfigHistory(entries=control.history())


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


@router.post(
    "/pause",
    response_model=LearnerStatus,
    tags=["control"],
    summary="Pause at the next step boundary",
    dependencies=[Authorized],
    responses=error_responses(401, 503),
)
def pause(runtime: Runtime) -> LearnerStatus:
    return runtime.pause()


@router.post(
    "/resume",
    response_model=LearnerStatus,
    tags=["control"],
    summary="Resume a paused learner",
    dependencies=[Authorized],
    responses=error_responses(401, 503),
)
def resume(runtime: Runtime) -> LearnerStatus:
    return runtime.resume()


@router.post(
    "/checkpoints",
    response_model=CheckpointResult,
    status_code=201,
    tags=["control"],
    summary="Write a checkpoint now",
    dependencies=[Authorized],
    responses=error_responses(401, 409, 503),
)
def checkpoint(runtime: Runtime) -> CheckpointResult:
    return runtime.checkpoint()


def _change(entry: ConfigEntry) -> ConfigChange:
    return ConfigChange(
        config_version=entry.config_version,
        status="applied" if entry.applied_at is not None else "pending",
        changed_fields=entry.changed_fields,
        config=entry.config,
    )
