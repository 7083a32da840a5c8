"""Health that tells the truth (hermetic fakes): a retrying loop is not ready but alive; a dead loop is
not alive (`/healthz` 503 with the reason) and the process is asked to exit non-zero after the grace."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ActorConfig
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.learner.config import LearnerConfig
from offpolicy.services.actor_api.main import create_app as create_actor_app
from offpolicy.services.common.background import EXIT_LOOP_FAILED, BackgroundLoop, ExitAfterGrace
from offpolicy.services.common.settings import ActorServiceSettings, LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.unit.actors.rollout.fakes import StubEngine
from tests.unit.services.learner_api.test_routes import FakeLearner


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class DyingLearner(FakeLearner):
    def run(self, stop_event: threading.Event) -> None:
        raise RuntimeError("checkpoint folder vanished")


def _learner_client(factory: type, grace_s: float = 30.0) -> TestClient:
    config = LearnerConfig(model_path="/models/tiny", redis_url="redis://127.0.0.1:1/0")
    settings = LearnerServiceSettings(fatal_exit_grace_s=grace_s)
    return TestClient(create_app(settings, config=config, learner_factory=factory))


def test_a_retrying_loop_is_alive_but_not_ready() -> None:
    with _learner_client(FakeLearner) as client:
        assert client.get("/healthz").status_code == 200
        learner = client.app.state.runtime.learner
        learner.state, learner.retrying = "waiting_for_redis", "StorageUnavailable: sample failed"
        r = client.get("/readyz")
        assert r.status_code == 503
        reason = r.json()["error"]["detail"]["checks"]["learner"]
        assert reason == "learner waiting_for_redis: StorageUnavailable: sample failed"
        assert client.get("/healthz").status_code == 200
        learner.state, learner.retrying = "running", None
        assert client.get("/readyz").json()["error"]["detail"]["checks"]["learner"] == "ok"  # redis: down


Exits = list[tuple[int, float | None, float]]


def _record_exits(fatal: ExitAfterGrace) -> Exits:
    """Install `fatal`'s exit hook (as `serve_app` does, before the app starts): each requested exit is
    recorded with the seconds then left until the deadline (0.0 once it has passed) and the time."""
    exits: Exits = []
    fatal.request_exit = lambda code: exits.append((code, fatal.exit_in_s(), time.monotonic()))
    return exits


def _check_exit_after_the_deadline(fatal: ExitAfterGrace, exits: Exits, started: float) -> None:
    """`started`: a time before the app started, so before the loop died."""
    assert exits == [] or fatal.exit_in_s() == 0.0  # not before the deadline
    wait_for(lambda: exits != [], timeout_s=5)
    assert [code for code, _, _ in exits] == [EXIT_LOOP_FAILED]
    _, left, at = exits[0]
    assert left == 0.0  # requested once the deadline (death + grace) had passed, not before
    assert at >= started + fatal.grace_s  # and that deadline was a grace after the death


def test_a_dead_loop_fails_healthz_with_its_reason_and_asks_to_exit_after_the_grace() -> None:
    client = _learner_client(DyingLearner, grace_s=0.3)
    fatal = client.app.state.fatal_exit
    exits = _record_exits(fatal)
    started = time.monotonic()
    with client:
        wait_for(lambda: client.app.state.runtime.loop.error is not None)
        r = client.get("/healthz")
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "loop_failed"
        detail = r.json()["error"]["detail"]
        assert detail["reason"] == "learner loop failed: RuntimeError: checkpoint folder vanished"
        assert 0.0 <= detail["exit_in_s"] <= 0.3
        status = client.get("/v1/status").json()
        assert (status["state"], status["error"]) == ("failed", "RuntimeError: checkpoint folder vanished")
        assert client.get("/readyz").status_code == 503
        _check_exit_after_the_deadline(fatal, exits, started)


def test_a_loop_that_returns_by_itself_stays_healthy() -> None:
    called: list[BaseException] = []
    loop = BackgroundLoop(lambda stop: None, "finite", called.append)
    loop.start()
    wait_for(lambda: not loop.running)
    assert (loop.failure(), called) == (None, [])


def test_exit_after_grace_without_a_hook_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    hook = ExitAfterGrace(0.0)
    assert hook.exit_in_s() is None
    hook(RuntimeError("x"))
    wait_for(lambda: "staying up" in caplog.text)
    assert hook.exit_in_s() == 0.0


class DyingActor:
    def __init__(self, config: Any, registry: CollectorRegistry, engine: Any) -> None:
        self.closed = False
        self.metrics = ActorMetrics(registry)

    def run(self, stop_event: Any) -> None:
        raise ValueError("reward function crashed")

    def status(self) -> dict[str, Any]:
        versions = {"loaded_policy_version": 0, "learner_policy_version": 0}
        return {
            "state": "running",
            "actor_id": "a0",
            **versions,
            "tokens_per_s": None,
            "groups_pushed": 0,
            "reloads": 0,
        }

    def close(self) -> None:
        self.closed = True


def test_the_actor_service_honours_the_same_contract() -> None:
    config = ActorConfig(model_path="/m", dataset={"path": "/d.jsonl"}, redis_url="redis://:pw-actor@h:1/0")
    app = create_actor_app(
        ActorServiceSettings(fatal_exit_grace_s=0.2),
        config=config,
        actor_factory=DyingActor,
        engine=StubEngine(),
    )
    exits = _record_exits(app.state.fatal_exit)
    started = time.monotonic()
    with TestClient(app) as client:
        wait_for(lambda: app.state.runtime.liveness() is not None)
        r = client.get("/healthz")
        assert r.status_code == 503
        assert (
            r.json()["error"]["detail"]["reason"] == "actor loop failed: ValueError: reward function crashed"
        )
        assert client.get("/v1/status").json()["state"] == "failed"
        _check_exit_after_the_deadline(app.state.fatal_exit, exits, started)
