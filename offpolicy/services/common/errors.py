"""The error envelope and the one table from domain errors to HTTP statuses, with its handlers.

Every error a service answers has the body `{"error": {"code", "message", "detail"}}`. Routes never build
error responses: they raise a domain error (a `buffer`, `learner` or `actors` error, or one of the service
errors below) and `ERROR_TABLE` decides its status and code, walking the exception's MRO so that a
subclass inherits its parent's row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from offpolicy.actors.errors import (
    ActorError,
    ActorNotRunning,
    BudgetExceeded,
    ChatRequestError,
    DatasetError,
    EngineError,
    EpisodeConflict,
    EpisodeNotFound,
    InvalidSampling,
    PolicyKindMismatch,
    PromptFailed,
    RewardError,
    RunConflict,
    RunFieldFrozen,
    RunNotFound,
    TooManyEpisodes,
    WeightLoadError,
)
from offpolicy.buffer.errors import (
    BufferError,
    BufferFull,
    BufferNotReady,
    ImagesMissing,
    InvalidTrajectory,
    RateLimited,
    StorageUnavailable,
)
from offpolicy.config.secrets import Redactor
from offpolicy.learner.errors import (
    BatchError,
    CheckpointMismatch,
    CheckpointsDisabled,
    CorrectionInputError,
    FrozenFieldChange,
    IntakeStopped,
    LearnerError,
    MemoryPlanError,
    TokenizerMismatch,
    UnknownPreset,
    WriteFailed,
)

log = logging.getLogger(__name__)

# --- the envelope (also the OpenAPI error models)


class ErrorBody(BaseModel):
    """What went wrong, machine-readable (`code`) and for humans (`message`)."""

    code: str
    """Stable snake_case error code, e.g. `validation_error`, `field_frozen`, `unauthorized`."""
    message: str
    """One sentence for humans."""
    detail: Any = None
    """Structured detail: field errors for 422, the frozen fields for 409; null when there is none."""


class ErrorResponse(BaseModel):
    """The one error envelope of every service."""

    error: ErrorBody


class FieldError(BaseModel):
    """One invalid field of a request body, as listed under `detail` of a 422."""

    field: str
    """Dotted path to the field, e.g. `body.rollout_correction.rollout_is_threshold`."""
    message: str
    """Why the value was rejected, with the value when pydantic gives it."""
    type: str
    """pydantic's error type, e.g. `greater_than`, `extra_forbidden`, `missing`."""


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses=` entry declaring the envelope for each status a route can answer."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


_DESCRIPTIONS = {
    400: "Bad request",
    401: "Missing or wrong bearer token",
    404: "Not found",
    409: "Conflict with the running state (a field that cannot change while running)",
    413: "Request body over the size limit (`OFFPOLICY_MAX_BODY_BYTES`)",
    422: "Invalid body; `detail` lists the field paths",
    429: "Rate limited",
    503: "Not ready (a dependency is unavailable)",
}

# --- the services' own errors


class ServiceError(Exception):
    """Base of the errors raised in `services/`; `detail` is structured JSON or None."""

    def __init__(self, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class Unauthorized(ServiceError):
    """A mutating route was called without the configured bearer token, or with a wrong one."""


class NotFound(ServiceError):
    """The named resource (a preset, a route) does not exist."""


class FieldFrozen(ServiceError):
    """A config change touches fields that cannot change while the loop runs; `detail.fields` names them."""


class Precondition(ServiceError):
    """The request is valid but the running state does not allow it (e.g. checkpoints are disabled)."""


class InvalidConfig(ServiceError):
    """A config body failed validation; `detail` is the list of `FieldError`s."""


class NotReady(ServiceError):
    """A readiness check failed or the domain object is not built yet; `detail` names the checks."""


class LoopFailed(ServiceError):
    """The service's loop died (an error it does not retry); the process exits after its grace period."""


class ChildProcessFailed(ServiceError):
    """A service child process exited or did not become ready in time (quickstart, e2e, benchmarks)."""


# --- the table

ERROR_TABLE: dict[type[BaseException], tuple[int, str]] = {
    # the services' own
    Unauthorized: (401, "unauthorized"),
    NotFound: (404, "not_found"),
    FieldFrozen: (409, "field_frozen"),
    Precondition: (409, "precondition_failed"),
    InvalidConfig: (422, "validation_error"),
    RequestValidationError: (422, "validation_error"),
    ValidationError: (422, "validation_error"),
    NotReady: (503, "not_ready"),
    LoopFailed: (503, "loop_failed"),
    ChildProcessFailed: (503, "child_process_failed"),
    # buffer/errors.py
    BufferError: (500, "buffer_error"),
    InvalidTrajectory: (422, "invalid_trajectory"),
    RateLimited: (429, "rate_limited"),
    BufferFull: (429, "buffer_full"),
    BufferNotReady: (503, "buffer_not_ready"),
    StorageUnavailable: (503, "storage_unavailable"),
    ImagesMissing: (404, "images_missing"),
    # learner/errors.py
    LearnerError: (500, "learner_error"),
    CorrectionInputError: (422, "invalid_correction_input"),
    UnknownPreset: (404, "not_found"),
    BatchError: (422, "invalid_batch"),
    FrozenFieldChange: (409, "field_frozen"),
    CheckpointsDisabled: (409, "checkpoints_disabled"),
    CheckpointMismatch: (409, "checkpoint_mismatch"),
    TokenizerMismatch: (422, "tokenizer_mismatch"),
    WriteFailed: (500, "write_failed"),
    IntakeStopped: (503, "intake_stopped"),
    MemoryPlanError: (422, "memory_plan_exceeds_device"),
    # actors/errors.py
    ActorError: (500, "actor_error"),
    DatasetError: (500, "dataset_error"),
    RewardError: (500, "reward_error"),
    WeightLoadError: (503, "weight_load_failed"),
    PolicyKindMismatch: (409, "policy_kind_mismatch"),
    EngineError: (500, "engine_error"),
    PromptFailed: (500, "prompt_failed"),
    EpisodeNotFound: (404, "episode_not_found"),
    EpisodeConflict: (409, "episode_conflict"),
    BudgetExceeded: (409, "episode_budget_exceeded"),
    ChatRequestError: (422, "unsupported_chat_request"),
    InvalidSampling: (422, "validation_error"),
    TooManyEpisodes: (429, "too_many_episodes"),
    ActorNotRunning: (503, "actor_not_running"),
    RunNotFound: (404, "run_not_found"),
    RunConflict: (409, "run_conflict"),
    RunFieldFrozen: (409, "field_frozen"),
}
"""(status, code) per error class; a subclass without a row inherits its nearest parent's (MRO order)."""

ERROR_DETAIL: dict[type[BaseException], Callable[[Any], Any]] = {
    ServiceError: lambda exc: exc.detail,
    FrozenFieldChange: lambda exc: {"fields": list(exc.fields)},
    RunFieldFrozen: lambda exc: {"fields": list(exc.fields)},
    InvalidTrajectory: lambda exc: {"field": exc.field},
    ChatRequestError: lambda exc: [
        {"field": f"body.{exc.field}", "message": str(exc), "type": "unsupported"}
    ],
    InvalidSampling: lambda exc: [{"field": f"body.{exc.field}", "message": str(exc), "type": "value_error"}],
    BudgetExceeded: lambda exc: {"needed": exc.needed, "left": exc.left},
    WeightLoadError: lambda exc: {"version": exc.version, "reason": exc.reason},
}
"""The envelope's `detail` for the error classes that carry structured fields (MRO order, like the table)."""


def status_for(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, code) of an exception by the first class in its MRO that the table names; else 500."""
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return 500, "internal_error"


def detail_for(exc: BaseException) -> Any:
    """The envelope's `detail` of a domain error (ERROR_DETAIL by MRO); None when it carries none."""
    for cls in type(exc).__mro__:
        if cls in ERROR_DETAIL:
            return ERROR_DETAIL[cls](exc)
    return None


def field_errors(errors: list[Any], prefix: tuple[str | int, ...] = ()) -> list[dict[str, str]]:
    """pydantic's error list as `FieldError` dicts with dotted field paths (JSON-safe, no context objects)."""
    out = []
    for err in errors:
        loc = (*prefix, *err.get("loc", ()))
        out.append(
            {
                "field": ".".join(str(part) for part in loc) or "body",
                "message": str(err.get("msg", "")),
                "type": str(err.get("type", "")),
            }
        )
    return out


def _envelope(
    request: Request, status: int, code: str, message: str, detail: Any = None, headers=None
) -> JSONResponse:
    """The envelope, with every secret the app knows (`app.state.redactor`) scrubbed from it. A 409 carries
    `x-should-retry: false` (the state it conflicts with does not change by waiting: the `openai` client
    and others read the header and do not spend their retries on it)."""
    if status == 409:
        headers = {**(headers or {}), "x-should-retry": "false"}
    body = ErrorResponse(error=ErrorBody(code=code, message=message, detail=detail)).model_dump(mode="json")
    redactor: Redactor | None = getattr(request.app.state, "redactor", None)
    if redactor is not None:
        body = redactor.scrub_json(body)
    return JSONResponse(status_code=status, content=body, headers=headers)


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    status, code = status_for(exc)
    if status >= 500 and code == "internal_error":
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return _envelope(request, status, code, "internal error; see the service log")
    detail = detail_for(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if isinstance(exc, BufferFull):  # back-pressure: the client waits this long, then retries
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    if isinstance(exc, ValidationError):
        detail = field_errors(exc.errors(include_url=False))
        return _envelope(request, status, code, f"{exc.error_count()} invalid field(s)", detail)
    return _envelope(request, status, code, str(exc), detail, headers)


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    detail = field_errors(list(exc.errors()))
    status, code = status_for(exc)
    return _envelope(request, status, code, f"{len(detail)} invalid field(s) in the request", detail)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
        exc.status_code, "http_error"
    )
    return _envelope(request, exc.status_code, code, str(exc.detail), None, exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Register the envelope handlers on `app`: the table for domain errors, 422s, HTTP errors, 500s."""
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for cls in ERROR_TABLE:
        if cls is not RequestValidationError:
            app.add_exception_handler(cls, _domain_error)
    app.add_exception_handler(Exception, _domain_error)
