"""The pusher against buffer stand-ins: an actor paced by a full buffer notices a stop (SIGTERM) within
`PACING_SLICE_S`, whatever `retry.pacing_timeout_s` is; groups stored by an insert whose reply was lost
count as pushed once (the actor's count is what the buffer holds)."""

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


class LostReply:
    """Stores each group once; the first insert stores its groups and then loses its reply (Redis went
    away after the write), as a kill or a `storage_timeout_s` can."""

    def __init__(self, lose_first: bool) -> None:
        self.stored: set[str] = set()
        self.lose_first = lose_first

    async def insert_many(self, groups):
        from offpolicy.buffer.errors import StorageUnavailable
        from offpolicy.buffer.types import InsertResult

        new = tuple(g.group_id for g in groups if g.group_id not in self.stored)
        dup = tuple(g.group_id for g in groups if g.group_id in self.stored)
        self.stored.update(new)
        if self.lose_first:
            self.lose_first = False
            raise StorageUnavailable("connection lost after the write")
        return InsertResult(inserted=new, duplicates=dup)


def test_groups_stored_by_an_insert_whose_reply_was_lost_count_as_pushed_not_as_duplicates():
    from types import SimpleNamespace

    from offpolicy.actors.rollout.submit import push_groups

    groups = [SimpleNamespace(group_id=f"g{i}", images=[]) for i in range(3)]
    retry = RetryConfig(initial_s=0.01, max_s=0.01)
    for lose, pushed, duplicates in ((True, 3, 0), (False, 0, 3)):
        registry, buffer = CollectorRegistry(), LostReply(lose)
        if not lose:  # a genuine duplicate (already stored before this call): not pushed by it
            buffer.stored.update(g.group_id for g in groups)
        n = asyncio.run(push_groups(buffer, groups, retry, ActorMetrics(registry), threading.Event()))
        assert n == pushed == registry.get_sample_value("offpolicy_actor_groups_pushed_total")
        assert registry.get_sample_value("offpolicy_actor_duplicate_groups_total") == duplicates
