"""An actor paced by a full buffer notices a stop (SIGTERM) within `PACING_SLICE_S`, whatever
`retry.pacing_timeout_s` is."""

from __future__ import annotations

import asyncio
import threading
import time

from prometheus_client import CollectorRegistry

from offpolicy.actors.config import RetryConfig
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.submit import PACING_SLICE_S, wait_for_room
from offpolicy.buffer.errors import RateLimited


class FullBuffer:
    """Always holds max_ahead fresh groups: each check waits its whole timeout, then refuses."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    async def wait_for_room(self, producer_version: int, timeout_s: float) -> int:
        self.timeouts.append(timeout_s)
        await asyncio.sleep(timeout_s)
        raise RateLimited(f"full for {timeout_s} s")


def test_a_stop_ends_the_pacing_wait_within_a_slice():
    buffer, stop = FullBuffer(), threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    asyncio.run(
        wait_for_room(buffer, 0, RetryConfig(pacing_timeout_s=25.0), ActorMetrics(CollectorRegistry()), stop)
    )
    assert time.monotonic() - t0 < PACING_SLICE_S + 0.5
    assert buffer.timeouts and max(buffer.timeouts) <= PACING_SLICE_S
