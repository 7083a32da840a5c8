"""The one table from domain errors to HTTP statuses: every buffer / learner / actor error has its row."""

from __future__ import annotations

import inspect

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import offpolicy.actors.errors
import offpolicy.buffer.errors
import offpolicy.learner.errors
from offpolicy.actors.errors import (
    BudgetExceeded,
    DatasetError,
    EngineError,
    InvalidSampling,
    RewardError,
    WeightLoadError,
)
from offpolicy.buffer.errors import (
    BufferFull,
    BufferNotReady,
    InvalidTrajectory,
    RateLimited,
    StorageUnavailable,
)
from offpolicy.learner.errors import (
    BatchError,
    CheckpointsDisabled,
    CorrectionInputError,
    FrozenFieldChange,
    LearnerError,
    UnknownPreset,
)
from offpolicy.services.common.errors import ERROR_TABLE, detail_for, install_error_handlers, status_for


def _domain_errors() -> list[type[BaseException]]:
    modules = (offpolicy.buffer.errors, offpolicy.learner.errors, offpolicy.actors.errors)
    return [
        cls
        for module in modules
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, Exception) and cls.__module__ == module.__name__
    ]


def test_every_domain_error_has_its_own_row() -> None:
    errors = _domain_errors()
    assert len(errors) == 7 + 11 + 17  # buffer, learner, actors: a new error class must be added here
    missing = [cls.__qualname__ for cls in errors if cls not in ERROR_TABLE]
    assert missing == []


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (InvalidTrajectory("trajectories[0].reward", "not finite"), 422, "invalid_trajectory"),
        (RateLimited("ratio"), 429, "rate_limited"),
        (BufferFull("max_bytes"), 429, "buffer_full"),
        (BufferNotReady("empty"), 503, "buffer_not_ready"),
        (StorageUnavailable("down"), 503, "storage_unavailable"),
        (LearnerError("x"), 500, "learner_error"),
        (CorrectionInputError("shapes"), 422, "invalid_correction_input"),
        (UnknownPreset("nope"), 404, "not_found"),
        (BatchError("empty"), 422, "invalid_batch"),
        (FrozenFieldChange(["model_path"]), 409, "field_frozen"),
        (CheckpointsDisabled("off"), 409, "checkpoints_disabled"),
        (DatasetError("missing"), 500, "dataset_error"),
        (RewardError("nan"), 500, "reward_error"),
        (WeightLoadError(3, "checksum", "mismatch"), 503, "weight_load_failed"),
        (EngineError("no logprobs"), 500, "engine_error"),
        (InvalidSampling("stop", "stop cannot contain an empty string."), 422, "validation_error"),
        (BudgetExceeded("past the budget", 301, 195), 409, "episode_budget_exceeded"),
    ],
)
def test_statuses(exc: BaseException, status: int, code: str) -> None:
    assert status_for(exc) == (status, code)


def test_subclass_without_a_row_takes_its_parents_and_unknown_is_500() -> None:
    class Mine(LearnerError):
        pass

    assert status_for(Mine("x")) == (500, "learner_error")
    assert status_for(KeyError("x")) == (500, "internal_error")


def test_details() -> None:
    assert detail_for(FrozenFieldChange(["model_path", "seed"])) == {"fields": ["model_path", "seed"]}
    assert detail_for(InvalidTrajectory("trajectories[1].reward", "nan")) == {
        "field": "trajectories[1].reward"
    }
    assert detail_for(WeightLoadError(7, "missing", "no dir")) == {"version": 7, "reason": "missing"}
    assert detail_for(CheckpointsDisabled("off")) is None


def test_frozen_field_change_answers_409_naming_the_fields() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/frozen")
    def frozen() -> dict:
        raise FrozenFieldChange(["model_path", "publish.weights_dir"])

    @app.get("/disabled")
    def disabled() -> dict:
        raise CheckpointsDisabled("checkpoints are disabled: checkpoint.checkpoint_dir is null")

    client = TestClient(app)
    r = client.get("/frozen")
    assert r.status_code == 409
    assert r.json() == {
        "error": {
            "code": "field_frozen",
            "message": "cannot change while running: model_path, publish.weights_dir",
            "detail": {"fields": ["model_path", "publish.weights_dir"]},
        }
    }
    r = client.get("/disabled")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "checkpoints_disabled")


def test_buffer_full_answers_429_with_retry_after() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/ingest")
    def ingest() -> dict:
        raise BufferFull("buffer full: 7 payload bytes stored of max_bytes=8", retry_after_s=2.4)

    r = TestClient(app).post("/ingest")
    assert (r.status_code, r.json()["error"]["code"], r.headers["Retry-After"]) == (429, "buffer_full", "2")
