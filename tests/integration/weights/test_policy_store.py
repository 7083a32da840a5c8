"""Policy record: atomic publish (SET + PUBLISH), read, and watch by pub/sub with polling fallback."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis

from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.keys import PolicyKeys
from offpolicy.weights.record import AsyncPolicyStore, PolicyRecord, PolicyStore

pytestmark = pytest.mark.redis


def _rec(v: int) -> PolicyRecord:
    return PolicyRecord(version=v, weights_uri=f"/weights/v{v}", sha256="0" * 64, published_at=1000.0 + v)


def test_publish_and_read(redis_url, run_id) -> None:
    store = PolicyStore(redis_url, run_id)
    assert store.read() is None
    assert store.publish(_rec(1)) == 0  # no subscriber yet
    assert store.read() == _rec(1)
    store.publish(_rec(2))
    assert store.read() == _rec(2)
    store.close()


def test_decode_rejects_bad_records() -> None:
    with pytest.raises(InvalidTrajectory) as e:
        PolicyRecord.decode(b'{"schema_version": 1, "version": "3"}')
    assert e.value.field == "policy.version"
    with pytest.raises(InvalidTrajectory) as e:
        PolicyRecord.decode(b'{"version": 3}')
    assert e.value.field == "policy.schema_version"


async def test_watch_pubsub(redis_url, run_id) -> None:
    store = AsyncPolicyStore(redis_url, run_id)
    await store.publish(_rec(1))
    seen: list[int] = []

    async def watch() -> None:
        async for rec in store.watch(poll_interval_s=30.0):  # long poll: only pub/sub can be this fast
            seen.append(rec.version)
            if rec.version == 3:
                return

    task = asyncio.create_task(watch())
    while not seen:
        await asyncio.sleep(0.01)
    assert await store.publish(_rec(2)) == 1  # the watcher is subscribed
    await store.publish(_rec(3))
    await asyncio.wait_for(task, 5)
    assert seen == [1, 2, 3]
    await store.close()


async def test_watch_polling_fallback(redis_url, run_id) -> None:
    store = AsyncPolicyStore(redis_url, run_id)
    seen: list[int] = []
    reads, read = [], store.read

    async def counted() -> PolicyRecord | None:  # the watcher's reads, counted
        reads.append(1)
        return await read()

    store.read = counted

    async def watch() -> None:
        async for rec in store.watch(poll_interval_s=0.05):
            seen.append(rec.version)
            return

    task = asyncio.create_task(watch())
    async with asyncio.timeout(5):  # its first read found nothing, and it polls: 7 can only come by a poll
        while len(reads) < 2:
            await asyncio.sleep(0.005)
    with redis.Redis.from_url(redis_url) as c:  # a record written without an announcement
        c.set(PolicyKeys.for_run(run_id).record, _rec(7).encode())
    await asyncio.wait_for(task, 5)
    assert seen == [7]
    await store.close()


async def test_watch_ends_on_one_cancel(redis_url, run_id) -> None:
    """redis-py's read timeout can swallow a cancel that lands as it expires (Python 3.11: 17 of 300
    cancels here before the fix); the watch must end on the first cancel all the same."""
    rng = random.Random(0)
    store = AsyncPolicyStore(redis_url, run_id)
    stuck = 0
    for _ in range(150):

        async def watch() -> None:
            async for _ in store.watch(poll_interval_s=0.002):  # its read timeout expires often
                pass

        task = asyncio.create_task(watch())
        await asyncio.sleep(rng.uniform(0.005, 0.03))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if not done:
            stuck += 1
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
    await store.close()
    assert stuck == 0
