"""`max_bytes`: the byte budget of stored + leased payloads, enforced by insert.lua; `BufferFull` as
back-pressure (the budget, or Redis' own maxmemory), never as an outage; the pusher waits and resumes."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import RetryConfig
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.submit import push_groups
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.errors import BufferFull
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer, ReplayBuffer
from offpolicy.weights.record import PolicyRecord, PolicyStore
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}
TOKENS = 64  # build_group(tokens=TOKENS, seed=0..9) all encode to the same length (prompt_id "p<seed>")


@pytest.fixture
def group_bytes(redis_url, run_id) -> int:
    """The payload length of one test group, as the buffer counts it."""
    with ReplayBuffer(redis_url, f"{run_id}-probe", BufferConfig(**FAST)) as b:
        b.insert(build_group(0, tokens=TOKENS))
        n = b.stats().payload_bytes
        b.clear()
    assert n > 0
    return n


@pytest.fixture
def buf(redis_url, run_id):
    made = []

    def make(registry=None, **cfg) -> ReplayBuffer:
        b = ReplayBuffer(redis_url, f"{run_id}-{len(made)}", BufferConfig(**{**FAST, **cfg}), registry)
        made.append(b)
        return b

    yield make
    for b in made:
        b.clear()
        b.close()


def groups(k: int) -> list:
    return [build_group(0, tokens=TOKENS, seed=i) for i in range(k)]


def full_count(reg: CollectorRegistry, reason: str) -> float:
    return reg.get_sample_value("offpolicy_buffer_full_total", {"reason": reason}) or 0.0


def test_an_insert_over_max_bytes_is_refused_until_the_learner_drains(buf, group_bytes) -> None:
    reg = CollectorRegistry()
    b = buf(reg, max_bytes=3 * group_bytes + group_bytes // 2, sampler="fifo")
    batch = groups(5)
    with pytest.raises(BufferFull, match=r"3 group\(s\) of the batch inserted"):
        b.insert_many(batch)
    s = b.stats()
    assert (s.size, s.payload_bytes) == (3, 3 * group_bytes)
    assert full_count(reg, "max_bytes") == 1
    # Leased groups still count: a lease alone frees nothing.
    leased = b.lease(2, 0, timeout_s=0, consumer="learner-0", lease_s=30)
    with pytest.raises(BufferFull):
        b.insert_many(batch)
    assert b.stats().payload_bytes == 3 * group_bytes
    # The ack frees them: the same batch again stores the rest (the first 3 are duplicates), nothing lost.
    b.ack("learner-0", leased.lease_ids)
    assert b.stats().payload_bytes == group_bytes
    result = b.insert_many(batch)
    assert (len(result.inserted), len(result.duplicates)) == (2, 3)
    assert b.stats().payload_bytes == 3 * group_bytes
    got = {g.group_id for g in leased.groups} | {g.group_id for g in b.sample(3, 0, timeout_s=0)}
    assert got == {g.group_id for g in batch}


def test_without_max_bytes_the_same_inserts_pass(buf, group_bytes) -> None:
    b = buf(max_bytes=0)  # 0: no byte bound (the session's Redis has no maxmemory either)
    assert len(b.insert_many(groups(5)).inserted) == 5
    assert b.stats().payload_bytes == 5 * group_bytes


def test_used_groups_make_room_unused_ones_never(buf, group_bytes) -> None:
    """With replay (max_times_sampled None) a group sampled at least once is evicted, oldest first, to make
    room for bytes; a group nobody has trained on is never evicted for bytes: the insert is refused."""
    reg = CollectorRegistry()
    b = buf(reg, max_bytes=3 * group_bytes, max_times_sampled=None, sampler="fifo")
    first = groups(3)
    b.insert_many(first)
    assert [g.group_id for g in b.sample(1, 0, timeout_s=0)] == [first[0].group_id]
    b.insert(build_group(0, tokens=TOKENS, seed=5))  # evicts first[0], the one used group
    s = b.stats()
    assert (s.size, s.payload_bytes, s.evicted_total["max_bytes"]) == (3, 3 * group_bytes, 1)
    assert reg.get_sample_value("offpolicy_buffer_evictions_total", {"reason": "max_bytes"}) == 1
    with pytest.raises(BufferFull):  # the three stored are unused: none is evicted
        b.insert(build_group(0, tokens=TOKENS, seed=6))
    assert b.stats().size == 3


def test_max_bytes_is_derived_from_redis_maxmemory(tmp_path, run_id, group_bytes) -> None:
    """max_bytes None: `max_bytes_share` of Redis' maxmemory; a `CONFIG SET maxmemory` is followed."""
    with EmbeddedRedis.start(tmp_path / "redis") as server:
        with redis.Redis.from_url(server.url) as c:
            c.config_set("maxmemory", 100 * 1024 * 1024)
        share = 4 * group_bytes / (100 * 1024 * 1024)
        with ReplayBuffer(server.url, run_id, BufferConfig(**FAST, max_bytes_share=share)) as b:
            b.insert_many(groups(4))
            with pytest.raises(BufferFull, match=f"max_bytes={4 * group_bytes}"):
                b.insert(build_group(0, tokens=TOKENS, seed=9))
            b.reconfigure(BufferConfig(**FAST, max_bytes_share=2 * share))  # re-read at the next insert
            assert b.insert(build_group(0, tokens=TOKENS, seed=9))
            b.reconfigure(BufferConfig(**FAST, max_bytes=0))  # explicitly unbounded
            assert len(b.insert_many(groups(8)[4:]).inserted) == 4


def test_redis_out_of_memory_is_buffer_full_not_an_outage(tmp_path, run_id) -> None:
    """No byte budget and Redis at its own maxmemory (noeviction): producers get BufferFull, not
    StorageUnavailable (an outage), and the counter says why; the learner's leases, acks and policy
    record still go through, and the acks free memory."""
    with EmbeddedRedis.start(tmp_path / "redis") as server:
        with redis.Redis.from_url(server.url) as c:
            used = int(c.info("memory")["used_memory"])
            c.config_set("maxmemory", used + 2 * 1024 * 1024)
            c.config_set("maxmemory-policy", "noeviction")
        reg = CollectorRegistry()
        with ReplayBuffer(server.url, run_id, BufferConfig(**FAST, max_bytes=0, sampler="fifo"), reg) as b:
            b.insert_many([build_group(0, tokens=1024, seed=i) for i in range(8)])
            leased = b.lease(4, 0, timeout_s=0, consumer="learner-0", lease_s=30)
            with pytest.raises(BufferFull, match="maxmemory"):
                for i in range(8, 10_000):
                    b.insert_many([build_group(0, tokens=1024, seed=i)])
            assert full_count(reg, "maxmemory") == 1 and full_count(reg, "max_bytes") == 0
            with redis.Redis.from_url(server.url) as c:
                assert int(c.info("memory")["used_memory"]) > used + 2 * 1024 * 1024 - 64 * 1024
                with pytest.raises(redis.exceptions.OutOfMemoryError):  # Redis refuses growing writes
                    c.set("something", "x" * 1000)
            # At maxmemory the learner still leases (the sample goes as a plain pipeline), acks, and
            # publishes its policy record (each script writes before it grows anything).
            more = b.lease(4, 0, timeout_s=0, consumer="learner-0", lease_s=30)
            store = PolicyStore(server.url, run_id)
            try:
                for v in (3, 4):  # the first creates the record, the second replaces it
                    store.publish(PolicyRecord(v, f"file:///w/v{v}", "0" * 64, time.time()))
                assert store.read().version == 4
            finally:
                store.close()
            assert b.ack("learner-0", [*leased.lease_ids, *more.lease_ids]).acked == 8
            assert b.insert(build_group(0, tokens=1024, seed=10_001))  # the acks made room


def test_stats_and_priorities_answer_while_redis_is_past_its_maxmemory(tmp_path, run_id) -> None:
    """Past maxmemory Redis queues nothing in a MULTI, reads included: the learner's stats and priorities
    (read as one snapshot) are sent again as a plain pipeline, not reported as an outage (CI saw the
    learner wait for Redis on `stats failed ... OutOfMemoryError` while producers held it at its limit)."""
    with EmbeddedRedis.start(tmp_path / "redis") as server:
        with redis.Redis.from_url(server.url) as c:
            used = int(c.info("memory")["used_memory"])
            c.config_set("maxmemory", used + 2 * 1024 * 1024)
            c.config_set("maxmemory-policy", "noeviction")
        cfg = BufferConfig(**FAST, max_bytes=0, sampler="prioritized")
        with ReplayBuffer(server.url, run_id, cfg) as b:
            first = build_group(0, tokens=1024, seed=0)
            b.insert(first)
            with pytest.raises(BufferFull, match="maxmemory"):
                for i in range(1, 10_000):
                    b.insert_many([build_group(0, tokens=1024, seed=i)])
            with (
                redis.Redis.from_url(server.url) as c,
                c.pipeline(transaction=True) as pipe,
                pytest.raises(redis.exceptions.OutOfMemoryError),  # a MULTI is refused outright
            ):
                pipe.hgetall(b._core.keys.counters).execute()
            stats = b.stats()
            assert stats.size == stats.inserted_total > 1
            assert b.priorities([first.group_id, "absent"])[0] is not None

            async def read_async():
                async with AsyncReplayBuffer(server.url, run_id, cfg) as a:
                    return await a.stats(), await a.priorities([first.group_id])

            async_stats, async_priorities = asyncio.run(read_async())
            assert async_stats.size == stats.size and async_priorities == b.priorities([first.group_id])


def test_the_pusher_waits_on_a_full_buffer_and_resumes_when_drained(
    redis_url, run_id, group_bytes, caplog
) -> None:
    """Two pushers against a 3-group budget, a learner thread draining slowly: every group arrives once,
    the pushers waited (`buffer_wait{reason="buffer_full"}`), and logged no error."""
    cfg = BufferConfig(**FAST, max_bytes=3 * group_bytes, sampler="fifo")
    reg = CollectorRegistry()
    metrics, retry, stop = ActorMetrics(reg), RetryConfig(initial_s=0.01, max_s=0.05), threading.Event()
    batches = [groups(4) for _ in range(3)]
    trained: list[str] = []
    done = threading.Event()

    def learner() -> None:
        with ReplayBuffer(redis_url, run_id, cfg) as b:
            while not (done.is_set() and b.stats().size == 0):
                try:
                    leased = b.lease(1, 0, timeout_s=0.2, consumer="learner-0", lease_s=30)
                except Exception:  # BufferNotReady: nothing yet
                    continue
                threading.Event().wait(0.05)  # the update
                b.ack("learner-0", leased.lease_ids)
                trained.extend(g.group_id for g in leased.groups)

    async def producers() -> list[int]:
        async with AsyncReplayBuffer(redis_url, run_id, cfg) as b:
            return await asyncio.gather(*(push_groups(b, x, retry, metrics, stop) for x in batches))

    drainer = threading.Thread(target=learner, daemon=True)
    drainer.start()
    with caplog.at_level(logging.INFO):
        pushed = asyncio.run(producers())
    done.set()
    drainer.join(30)
    assert not drainer.is_alive()
    assert pushed == [4, 4, 4]
    assert sorted(trained) == sorted(g.group_id for x in batches for g in x)
    assert reg.get_sample_value("offpolicy_actor_buffer_wait_seconds_total", {"reason": "buffer_full"}) > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("buffer full" in r.getMessage() for r in caplog.records)
    with ReplayBuffer(redis_url, run_id, cfg) as b:
        b.clear()
