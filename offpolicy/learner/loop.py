"""The loop around the learner's step (`Learner.run`, learner/trainer.py): it waits out an empty buffer (state
`waiting_for_data`, retry every 0.5 s) and transient trouble (`TRANSIENT_ERRORS`: Redis unreachable),
retried with capped exponential backoff for as long as it lasts (state `waiting_for_redis`, `retrying` the
reason), then stepping resumes by itself. A full disk is back-pressure (persist/durable_writes.py):
publishes and checkpoints are retried in the background while training goes on, until
`checkpoint.max_undurable_steps` steps are not covered by a durable checkpoint; then the loop takes no new
groups (state `waiting_for_checkpoint`, `retrying` the reason) until one lands. While paused or waiting the
leader sends heartbeats, so its followers hear of a config change or a checkpoint request. Any other error
propagates (the loop is dead: the service reports it and exits after a grace).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from offpolicy.buffer.errors import BufferNotReady, RateLimited, StorageUnavailable
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed import HEARTBEAT_S, Ranks
from offpolicy.learner.errors import IntakeStopped, WriteFailed
from offpolicy.learner.persist.writer import back_pressure

log = logging.getLogger(__name__)

TRANSIENT_ERRORS = (StorageUnavailable,)
"""Errors `run` retries for as long as they last (Redis unreachable, after the buffer's own bounded
retries), raised by the step itself or as the cause of a failed background write (the policy record's
publish: the weights are on disk, the next publish supersedes it); any other error ends `run` (the service
then reports the loop dead and exits after a grace)."""
RETRY_INITIAL_S, RETRY_MAX_S = 0.5, 10.0
"""`run`'s backoff between steps while transient errors last: doubles from the first to the cap, seconds."""


class Looped(Protocol):
    """What the loop drives and sets: the `Learner` (learner/trainer.py)."""

    config: LearnerConfig
    ranks: Ranks
    step_count: int
    state: str
    retrying: str | None

    def wait_unpaused(self, timeout_s: float) -> bool: ...
    def heartbeat(self) -> None: ...
    def step(self) -> dict[str, Any]: ...


def run_loop(learner: Looped, stop_event: threading.Event) -> None:
    """`Learner.run`'s loop: `step()` until `stop_event` or `max_steps`, waiting out what the module
    docstring says; any other error propagates (the loop is dead)."""
    delay = RETRY_INITIAL_S
    while not stop_event.is_set():
        if not learner.wait_unpaused(HEARTBEAT_S if learner.ranks.distributed else 0.2):
            learner.heartbeat()  # paused: the followers hear from us, a checkpoint() is still served
            continue
        if learner.config.max_steps is not None and learner.step_count >= learner.config.max_steps:
            learner.state = "finished"
            return
        try:
            learner.step()
        except (BufferNotReady, RateLimited) as exc:  # no data yet: wait and retry, bounded by the loop
            learner.state, learner.retrying, delay = "waiting_for_data", None, RETRY_INITIAL_S
            log.info("no groups to train on yet: %s", exc)
            learner.heartbeat()
            stop_event.wait(0.5)
        except IntakeStopped as exc:  # checkpoints failing, at the cap: no new groups until one lands
            if learner.state != "waiting_for_checkpoint":
                log.warning("%s", exc)
            learner.state, learner.retrying, delay = "waiting_for_checkpoint", str(exc), RETRY_INITIAL_S
            learner.heartbeat()
            stop_event.wait(0.5)
        except (
            *TRANSIENT_ERRORS,
            WriteFailed,
        ) as exc:  # retried for as long as it lasts, the wait capped
            if isinstance(exc, WriteFailed) and back_pressure(exc.__cause__):
                log.warning("%s (retried in the background)", exc)  # a flush that met a full disk
                stop_event.wait(RETRY_INITIAL_S)
                continue
            if isinstance(exc, WriteFailed) and not isinstance(exc.__cause__, TRANSIENT_ERRORS):
                raise
            learner.state, learner.retrying = "waiting_for_redis", f"{type(exc).__name__}: {exc}"
            log.warning("redis unavailable, retrying in %.1f s: %s", delay, exc)
            for _ in range(max(1, round(delay / HEARTBEAT_S))):  # heartbeats while it lasts
                learner.heartbeat()
                if stop_event.wait(min(delay, HEARTBEAT_S)):
                    break
            delay = min(2 * delay, RETRY_MAX_S)
        else:
            learner.retrying, delay = None, RETRY_INITIAL_S
    learner.state = "stopped"
