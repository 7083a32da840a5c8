"""`Learner.run`'s retry policy, with `step` scripted: Redis trouble (directly, or as the cause of a failed
background publish) is retried with backoff and reported in `state` / `retrying`; anything else ends `run`.

Only `run` is under test here; the real step against a real Redis outage is
tests/integration/services/test_health.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from offpolicy.buffer.errors import BufferNotReady, StorageUnavailable
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed import SINGLE
from offpolicy.learner.errors import WriteFailed
from offpolicy.learner.loop import RETRY_INITIAL_S
from offpolicy.learner.trainer import Learner


class ScriptedLearner(Learner):
    """`run` as written, over a `step` that raises the scripted errors in order (None = a good step)."""

    def __init__(self, script: list[BaseException | None]) -> None:  # no model, no Redis: `run` only
        config = LearnerConfig(model_path="/m", max_steps=sum(s is None for s in script))
        self.configs = SimpleNamespace(config=config)  # `config` reads the switch's
        self.ranks, self.channel = SINGLE, None
        self.step_count, self.state, self.retrying = 0, "running", None
        self._running = threading.Event()
        self._running.set()
        self.script, self.seen = list(script), []

    def step(self) -> dict[str, float]:
        self.seen.append((self.state, self.retrying, time.monotonic()))
        error = self.script.pop(0)
        if error is not None:
            raise error
        self.step_count += 1
        self.state = "running"
        return {}


def test_redis_trouble_is_retried_with_backoff_and_reported() -> None:
    publish_failed = WriteFailed("weights", 3, StorageUnavailable("publish failed after 9 attempt(s)"))
    learner = ScriptedLearner([None, StorageUnavailable("sample failed"), publish_failed, None, None])
    learner.run(threading.Event())
    assert learner.state == "finished" and learner.step_count == 3
    states = [(s, r) for s, r, _ in learner.seen]
    assert states[2] == ("waiting_for_redis", "StorageUnavailable: sample failed")
    assert states[3][0] == "waiting_for_redis" and states[3][1].startswith("WriteFailed: background weights")
    assert states[4] == ("running", None)  # the good step after the outage cleared it
    gaps = [b[2] - a[2] for a, b in zip(learner.seen[1:3], learner.seen[2:4], strict=True)]
    assert gaps[0] >= RETRY_INITIAL_S * 0.9 and gaps[1] >= 2 * RETRY_INITIAL_S * 0.9  # doubled


def test_a_full_disk_met_by_a_flush_does_not_end_run() -> None:
    """A flush that meets a failing write (an OSError: retried in the background) is not a bug."""
    learner = ScriptedLearner([None, WriteFailed("checkpoint", 4, OSError(28, "No space left")), None])
    learner.run(threading.Event())
    assert learner.state == "finished" and learner.step_count == 2


def test_no_data_is_not_trouble() -> None:
    learner = ScriptedLearner([BufferNotReady("empty"), None])
    learner.run(threading.Event())
    assert learner.seen[1][:2] == ("waiting_for_data", None)


@pytest.mark.parametrize(
    "error", [WriteFailed("checkpoint", 4, TypeError("a bug")), RuntimeError("bug"), ValueError("nan loss")]
)
def test_anything_else_ends_run(error: BaseException) -> None:
    learner = ScriptedLearner([None, error, None])
    with pytest.raises(type(error)):
        learner.run(threading.Event())
