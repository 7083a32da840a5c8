"""The learner's loop: step until stopped, waiting out an empty buffer and transient trouble.

No data yet: state `waiting_for_data`, retry every 0.5 s. Transient trouble (`TRANSIENT_ERRORS`: Redis
unreachable) is retried with capped exponential backoff for as long as it lasts: state `waiting_for_redis`
and `retrying` (the reason) until a step gets through again, then stepping resumes by itself. Any other
error propagates (the loop is dead). While paused or waiting, a leader of N ranks keeps sending heartbeats
(`Learner.heartbeat`), so its followers hear of a config change or a checkpoint request.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from buffer.errors import BufferNotReady, RateLimited, StorageUnavailable
from learner.distributed import HEARTBEAT_S
from learner.errors import WriteFailed

if TYPE_CHECKING:
    from learner.train import Learner

log = logging.getLogger(__name__)

TRANSIENT_ERRORS = (StorageUnavailable,)
"""Errors `run` retries for as long as they last (Redis unreachable, after the buffer's own bounded
retries), raised by the step itself or as the cause of a failed background write (the policy record's
publish: the weights are on disk, the next publish supersedes it); any other error ends `run` (the service
then reports the loop dead and exits after a grace)."""
RETRY_INITIAL_S, RETRY_MAX_S = 0.5, 10.0
"""`run`'s backoff between steps while transient errors last: doubles from the first to the cap, seconds."""


def run_steps(learner: Learner, stop_event: threading.Event) -> None:
    """Loop `learner.step()` until `stop_event` is set or `max_steps` is reached; waits while paused."""
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
        except (
            *TRANSIENT_ERRORS,
            WriteFailed,
        ) as exc:  # retried for as long as it lasts, the wait capped
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
