"""`AsyncReplayBuffer`: the asyncio twin of `ReplayBuffer` (buffer/replay_buffer.py), for actors and services.

Same scripts, same codec, same errors, same `Core` (buffer/core.py); it only awaits where the sync buffer
blocks. Its methods' contracts are written once, on `ReplayBuffer`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from offpolicy.buffer.core import (
    CountRejected,
    DecodedSample,
    InsertOutcome,
    InsertStep,
    ReadMaxmemory,
    SendChunk,
    Wait,
    make_result,
    merge_priorities,
)
from offpolicy.buffer.errors import BufferFull, RateLimited
from offpolicy.buffer.handle import BufferHandle
from offpolicy.buffer.images import found_images
from offpolicy.buffer.leases import AsyncLeaseOps
from offpolicy.buffer.rate_limiter import SampleStatus, sample_refused
from offpolicy.buffer.script_io import LeaseArgs
from offpolicy.buffer.storage import (
    async_client,
    call_async,
    insert_transaction_async,
    read_maxmemory_async,
    read_snapshot_async,
    sample_transaction_async,
)
from offpolicy.buffer.types import BufferStats, InsertResult, TrajectoryGroup


class AsyncReplayBuffer(BufferHandle, AsyncLeaseOps):
    """The asyncio twin of `ReplayBuffer` (actors and services); same scripts, same codec, same errors."""

    _make_client = staticmethod(async_client)

    async def _call(self, fn, what: str, full_on_oom: bool = False):
        try:
            return await call_async(
                fn, self.config.storage_timeout_s, what, self._core.metrics.storage_retries.inc, full_on_oom
            )
        except BufferFull:
            self._core.metrics.full_by["maxmemory"].inc()
            raise

    async def insert(self, group: TrajectoryGroup, images: Mapping[str, bytes] | None = None) -> bool:
        """Insert one group; False when its group_id was already inserted. Invalid: `InvalidTrajectory`."""
        inserted, _, rejected = await self._insert_many([group], images)
        if rejected:
            raise next(iter(rejected.values()))
        return bool(inserted)

    async def insert_many(
        self, groups: Sequence[TrajectoryGroup], images: Mapping[str, bytes] | None = None
    ) -> InsertResult:
        """See `ReplayBuffer.insert_many`."""
        return make_result(*(await self._insert_many(groups, images)))

    async def _insert_many(
        self, groups: Sequence[TrajectoryGroup], images: Mapping[str, bytes] | None = None
    ) -> InsertOutcome:
        """`Core.insert_steps`, each step performed with an await."""
        steps = self._core.insert_steps(groups, images)
        result = None
        while True:
            try:
                step = steps.send(result)
            except StopIteration as done:
                return done.value
            result = await self._perform(step)

    async def _perform(self, step: InsertStep) -> Any:
        """See `ReplayBuffer._perform`."""
        match step:
            case CountRejected(counts=counts):
                return await self._call(lambda: self._count(counts), step.what)
            case ReadMaxmemory():
                return await self._call(lambda: read_maxmemory_async(self._client), step.what)
            case SendChunk(entries=entries, max_bytes=max_bytes, read_table=read_table, images=images):
                keys = self._core.keys
                raw, table = await self._call(
                    lambda: insert_transaction_async(
                        self._client, self._insert, self.config, keys, entries, max_bytes, read_table, images
                    ),
                    step.what,
                    full_on_oom=step.full_on_oom,
                )
                self._adopt(table)
                return raw
            case Wait(seconds=seconds):
                await asyncio.sleep(seconds)
        return None

    async def _count(self, counts: dict[str, int]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for name, n in counts.items():
            pipe.hincrby(self._core.keys.counters, name, n)
        await pipe.execute()

    async def images(self, shas: Iterable[str], missing_ok: bool = False) -> dict[str, bytes]:
        """See `ReplayBuffer.images`."""
        names = list(dict.fromkeys(shas))
        if not names:
            return {}
        keys = [self._core.keys.image(sha) for sha in names]
        return found_images(names, await self._call(lambda: self._client.mget(keys), "images"), missing_ok)

    async def sample(
        self, num_groups: int, consumer_version: int, timeout_s: float = 10.0
    ) -> list[TrajectoryGroup]:
        """See `ReplayBuffer.sample`."""
        return (await self._take(num_groups, consumer_version, timeout_s, None)).groups

    async def _take(
        self, num_groups: int, consumer_version: int, timeout_s: float, lease: LeaseArgs | None
    ) -> DecodedSample:
        """See `ReplayBuffer._take`."""
        t0 = time.perf_counter()
        core = self._core
        core.check_sample(num_groups)
        backoff = core.backoff(timeout_s)
        while True:
            reply = await self._call(
                lambda: sample_transaction_async(
                    self._client, self._sample, self.config, core.keys, num_groups, consumer_version, lease
                ),
                "sample",
            )
            core.on_sample(reply)
            if reply.status is SampleStatus.DRAINING:
                continue
            if reply.status is SampleStatus.OK and core.missing(reply.payloads) < len(reply.payloads):
                taken = core.take(reply, consumer_version)
                if taken.bad:
                    await self._set_aside(lease and lease.consumer, taken)
                if taken.groups:
                    break
            delay = backoff.delay()
            if delay is None:
                raise sample_refused(reply.status, num_groups, reply.size, timeout_s)
            core.metrics.waits["sample"].inc()
            await asyncio.sleep(delay)
        core.metrics.sample_latency.observe(time.perf_counter() - t0)
        return taken

    async def wait_for_room(self, producer_version: int, timeout_s: float = 60.0) -> int:
        """See `ReplayBuffer.wait_for_room`."""
        k = self._core.keys
        backoff = self._core.backoff(timeout_s)
        while True:
            floor = self._core.fresh_floor(producer_version)
            fresh = await self._call(lambda f=floor: self._client.zcount(k.by_version, f, "+inf"), "pace")
            if self.config.max_ahead is None or fresh < self.config.max_ahead:
                return fresh
            delay = backoff.delay()
            if delay is None:
                raise RateLimited(
                    f"{fresh} fresh groups >= max_ahead={self.config.max_ahead} for {timeout_s} s"
                )
            self._core.metrics.waits["pace"].inc()
            await asyncio.sleep(delay)

    async def priorities(self, group_ids: Sequence[str]) -> list[float | None]:
        """See `ReplayBuffer.priorities`."""
        ids = list(group_ids)
        if not ids:
            return []
        k = self._core.keys

        async def read():
            queue = lambda pipe: pipe.zmscore(k.priority, ids).hmget(k.held, ids)  # noqa: E731
            return await read_snapshot_async(self._client, queue)

        return merge_priorities(*(await self._call(read, "priorities")))

    async def stats(self) -> BufferStats:
        """See `ReplayBuffer.stats`."""
        read = lambda: read_snapshot_async(self._client, self._core.queue_stats)  # noqa: E731
        return self._core.stats(*(await self._call(read, "stats")))

    async def clear(self) -> None:
        """See `ReplayBuffer.clear`."""
        k = self._core.keys

        async def clear() -> None:
            await self._client.delete(*k.indexes())
            for pattern in k.per_group_patterns():
                names = [n async for n in self._client.scan_iter(match=pattern, count=1000)]
                for i in range(0, len(names), 1000):
                    await self._client.unlink(*names[i : i + 1000])

        await self._call(clear, "clear")

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def __aenter__(self) -> AsyncReplayBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
