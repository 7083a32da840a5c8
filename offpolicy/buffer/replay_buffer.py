"""`ReplayBuffer` (sync, for the learner), the twin of `AsyncReplayBuffer` (asyncio, for actors and services).

Both drive the same Lua scripts (scripts/insert.lua, scripts/sample.lua) and the same codec; `Core`
(buffer/core.py) holds what they share, so the two classes only differ in how they wait and call Redis.
Payload bytes never pass through Lua, and each call is one round trip: an insert is one MULTI/EXEC of
`SET NX`s of the payloads plus the insert script (which indexes them or deletes the ones it refuses); a
sample is one MULTI/EXEC of the sample script (which renames or copies the chosen payloads to keys of
this call) plus one MGET and one UNLINK of those keys.

`AsyncReplayBuffer` lives in buffer/async_replay_buffer.py and is importable from here too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from offpolicy.buffer.async_replay_buffer import AsyncReplayBuffer
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
from offpolicy.buffer.leases import LeaseOps
from offpolicy.buffer.rate_limiter import SampleStatus, sample_refused
from offpolicy.buffer.script_io import LeaseArgs
from offpolicy.buffer.storage import (
    call_sync,
    insert_transaction,
    read_maxmemory,
    read_snapshot,
    sample_transaction,
)
from offpolicy.buffer.types import BufferStats, InsertResult, TrajectoryGroup

__all__ = ["AsyncReplayBuffer", "ReplayBuffer"]  # AsyncReplayBuffer: buffer/async_replay_buffer.py


class ReplayBuffer(BufferHandle, LeaseOps):
    """Synchronous replay buffer over Redis (the learner's side; also used by tests and tools)."""

    def _call(self, fn, what: str, full_on_oom: bool = False):
        try:
            return call_sync(
                fn, self.config.storage_timeout_s, what, self._core.metrics.storage_retries.inc, full_on_oom
            )
        except BufferFull:
            self._core.metrics.full_by["maxmemory"].inc()
            raise

    def insert(self, group: TrajectoryGroup, images: Mapping[str, bytes] | None = None) -> bool:
        """Insert one group; False when its group_id was already inserted. Invalid: `InvalidTrajectory`."""
        inserted, _, rejected = self._insert_many([group], images)
        if rejected:
            raise next(iter(rejected.values()))
        return bool(inserted)

    def insert_many(
        self, groups: Sequence[TrajectoryGroup], images: Mapping[str, bytes] | None = None
    ) -> InsertResult:
        """Insert a batch; invalid groups are rejected (by field) without affecting the valid ones.

        `images` (sha256 hex -> the encoded image) holds the bytes of the images the groups name
        (`TrajectoryGroup.images`), each sent once however many groups name it, and stored once: a group
        of n completions of one image, or every later group of an agent naming a screenshot already
        stored, adds a reference, not bytes. An image may be left out when it is stored already; a group
        naming one that is neither sent nor stored is rejected (`images`), as is one naming an image
        whose bytes hash to another name (`images[i]`). An image counts in the buffer's bytes while a
        stored group names it and leaves the buffer with the last of them (acked, evicted, stale or
        dead-lettered).

        Waits (bounded by `insert_timeout_s`) while the samples_per_insert limiter refuses, then raises
        `RateLimited`; groups inserted before that stay inserted and retrying the batch is a no-op for them.
        Over `max_bytes` (or with Redis at its own `maxmemory`) it raises `BufferFull` at once, without
        waiting: the producer backs off (the actors' pusher waits and retries; HTTP ingest answers 429).
        """
        return make_result(*self._insert_many(groups, images))

    def _insert_many(
        self, groups: Sequence[TrajectoryGroup], images: Mapping[str, bytes] | None = None
    ) -> InsertOutcome:
        """`Core.insert_steps`, each step performed with a blocking call."""
        steps = self._core.insert_steps(groups, images)
        result = None
        while True:
            try:
                step = steps.send(result)
            except StopIteration as done:
                return done.value
            result = self._perform(step)

    def _perform(self, step: InsertStep) -> Any:
        """One step of the insert loop (buffer/core.py): its I/O, and what it sends back."""
        match step:
            case CountRejected(counts=counts):
                return self._call(lambda: self._count(counts), step.what)
            case ReadMaxmemory():
                return self._call(lambda: read_maxmemory(self._client), step.what)
            case SendChunk(entries=entries, max_bytes=max_bytes, read_table=read_table, images=images):
                keys = self._core.keys
                raw, table = self._call(
                    lambda: insert_transaction(
                        self._client, self._insert, self.config, keys, entries, max_bytes, read_table, images
                    ),
                    step.what,
                    full_on_oom=step.full_on_oom,
                )
                self._adopt(table)
                return raw
            case Wait(seconds=seconds):
                time.sleep(seconds)
        return None

    def _count(self, counts: dict[str, int]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for name, n in counts.items():
            pipe.hincrby(self._core.keys.counters, name, n)
        pipe.execute()

    def images(self, shas: Iterable[str], missing_ok: bool = False) -> dict[str, bytes]:
        """The bytes of the images `shas` (sha256 hex) that the buffer holds: those a stored group names
        (a leased group's stay until its ack), and for `IMAGE_GRACE_S` after it, those only the groups a
        sample just consumed named. Raises `ImagesMissing` naming any it does not hold (`missing_ok`:
        leaves them out)."""
        names = list(dict.fromkeys(shas))
        if not names:
            return {}
        keys = [self._core.keys.image(sha) for sha in names]
        return found_images(names, self._call(lambda: self._client.mget(keys), "images"), missing_ok)

    def sample(
        self, num_groups: int, consumer_version: int, timeout_s: float = 10.0
    ) -> list[TrajectoryGroup]:
        """Sample `num_groups` distinct groups no staler than `max_staleness` for a learner at
        `consumer_version`; waits (bounded by `timeout_s`) while a limiter refuses, then raises
        `RateLimited` (samples_per_insert) or `BufferNotReady` (min size, too few fresh groups).
        Each sampled group counts as used at once (use `lease` for at-least-once delivery). Fewer than
        `num_groups` when chosen groups' payloads had been deleted behind the buffer's back (counted as
        dropped `payload_missing`) or fail to decode (set aside as dead letters, counted
        `dropped:invalid:<field>`); when none is left, it waits and samples again."""
        return self._take(num_groups, consumer_version, timeout_s, None).groups

    def _take(
        self, num_groups: int, consumer_version: int, timeout_s: float, lease: LeaseArgs | None
    ) -> DecodedSample:
        """The sample loop of `sample` (lease None: consume) and `lease`."""
        t0 = time.perf_counter()
        core = self._core
        core.check_sample(num_groups)
        backoff = core.backoff(timeout_s)
        while True:
            reply = self._call(
                lambda: sample_transaction(
                    self._client, self._sample, self.config, core.keys, num_groups, consumer_version, lease
                ),
                "sample",
            )
            core.on_sample(reply)
            if reply.status is SampleStatus.DRAINING:  # stale groups left to drop: at once, no wait
                continue
            if reply.status is SampleStatus.OK and core.missing(reply.payloads) < len(reply.payloads):
                taken = core.take(reply, consumer_version)
                if taken.bad:
                    self._set_aside(lease and lease.consumer, taken)
                if taken.groups:
                    break
            # refused, or every chosen payload missing or poison: wait and choose again
            delay = backoff.delay()
            if delay is None:
                raise sample_refused(reply.status, num_groups, reply.size, timeout_s)
            core.metrics.waits["sample"].inc()
            time.sleep(delay)
        core.metrics.sample_latency.observe(time.perf_counter() - t0)
        return taken

    def wait_for_room(self, producer_version: int, timeout_s: float = 60.0) -> int:
        """Producer pacing: hold while >= `max_ahead` groups a learner at `producer_version` could still
        sample are stored; return that count once below, or raise `RateLimited` after `timeout_s`."""
        k = self._core.keys
        backoff = self._core.backoff(timeout_s)
        while True:
            floor = self._core.fresh_floor(producer_version)
            fresh = self._call(lambda f=floor: self._client.zcount(k.by_version, f, "+inf"), "pace")
            if self.config.max_ahead is None or fresh < self.config.max_ahead:
                return fresh
            delay = backoff.delay()
            if delay is None:
                raise RateLimited(
                    f"{fresh} fresh groups >= max_ahead={self.config.max_ahead} for {timeout_s} s"
                )
            self._core.metrics.waits["pace"].inc()
            time.sleep(delay)

    def priorities(self, group_ids: Sequence[str]) -> list[float | None]:
        """The `prioritized` sampler's current priority of each group (indexed or held; None: none, or
        not stored): what prioritized replay's importance weights are computed from."""
        ids = list(group_ids)
        if not ids:
            return []
        k = self._core.keys

        def read():
            queue = lambda pipe: pipe.zmscore(k.priority, ids).hmget(k.held, ids)  # noqa: E731
            return read_snapshot(self._client, queue)

        return merge_priorities(*self._call(read, "priorities"))

    def publish_table(self) -> None:
        """The learner's side: store this config's table-wide fields for the producers that follow it."""
        raw = self.config.table_json()
        self._call(lambda: self._client.set(self._core.keys.table, raw), "publish buffer config")

    def stats(self) -> BufferStats:
        """Size, lifetime counters (the learner's buffer position) and the stored version range."""
        read = lambda: read_snapshot(self._client, self._core.queue_stats)  # noqa: E731
        return self._core.stats(*self._call(read, "stats"))

    def clear(self) -> None:
        """Delete every key of this buffer: indexes, dedupe set, counters, then (SCAN) every payload key
        (out keys too, though a sample transaction never leaves one behind)."""
        k = self._core.keys

        def clear() -> None:
            self._client.delete(*k.indexes())
            for pattern in k.per_group_patterns():
                names = list(self._client.scan_iter(match=pattern, count=1000))
                for i in range(0, len(names), 1000):
                    self._client.unlink(*names[i : i + 1000])

        self._call(clear, "clear")

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
