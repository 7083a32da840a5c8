"""Leases on Redis 6.2 and 7.x: lease / ack / renew / release / expiry on queue and replay tables, uses
counted on ack, counters in `stats()` and Prometheus, and a consumer restarting under the same name."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.errors import BufferNotReady, RateLimited
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}
C = "learner-0"


def _versions(groups) -> list[int]:
    return [g.policy_version for g in groups]


def _payload_exists(raw, keys, group) -> bool:
    return bool(raw.exists(keys.payload(group.group_id)))


def test_queue_a_leased_group_is_not_sampleable_until_released(env) -> None:
    make, raw, keys = env
    b = make(max_times_sampled=1)
    groups = [build_group(v, seed=v) for v in range(4)]
    b.insert_many(groups)
    first = b.lease(2, 3, consumer=C, lease_s=60)
    second = b.lease(2, 3, consumer=C, lease_s=60)
    assert _versions(first.groups) == [0, 1] and _versions(second.groups) == [2, 3]
    assert len(set(first.lease_ids + second.lease_ids)) == 4
    with pytest.raises(BufferNotReady):
        b.lease(1, 3, consumer=C, lease_s=60, timeout_s=0)
    s = b.stats()
    assert (s.size, s.held, s.leased_total, s.leases_outstanding, s.sampled_total) == (4, 4, 4, 4, 0)
    assert b.leases(C) == sorted(first.lease_ids + second.lease_ids, key=int)

    acked = b.ack(C, first.lease_ids)
    assert (acked.acked, acked.retired, acked.unknown) == (2, 2, ())
    assert not any(_payload_exists(raw, keys, g) for g in first.groups)  # deleted at its last ack
    assert all(_payload_exists(raw, keys, g) for g in second.groups)  # leased: still in Redis
    assert b.release(C) == 2
    assert _versions(b.sample(2, 3, timeout_s=0)) == [2, 3]  # back in insert order
    s = b.stats()
    assert (s.acked_total, s.redelivered_total, s.leases_outstanding, s.sampled_total) == (2, 2, 0, 4)
    assert s.evicted_total == {"max_times_sampled": 4} and s.size == 0


def test_replay_the_same_group_leased_twice_gets_two_lease_ids(env) -> None:
    make, _, _ = env
    b = make(sampler="uniform", max_times_sampled=None)
    b.insert(build_group(0))
    one, two = (b.lease(1, 0, consumer=C, lease_s=60) for _ in range(2))
    assert one.groups[0].group_id == two.groups[0].group_id
    assert one.lease_ids != two.lease_ids
    assert b.ack(C, one.lease_ids + two.lease_ids).acked == 2
    assert b.ack(C, one.lease_ids).unknown == tuple(one.lease_ids)  # acked once only
    s = b.stats()
    assert (s.size, s.sampled_total, s.acked_total, s.leases_outstanding) == (1, 2, 2, 0)


def test_max_times_sampled_counts_acked_uses(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_times_sampled=2)
    g = build_group(0)
    b.insert(g)
    a = b.lease(1, 0, consumer=C, lease_s=60)
    c = b.lease(1, 0, consumer=C, lease_s=60)  # acked 0 + outstanding 2: held
    with pytest.raises(BufferNotReady):
        b.lease(1, 0, consumer=C, lease_s=60, timeout_s=0)
    assert b.release(C, c.lease_ids) == 1  # one use back: sampleable again
    d = b.lease(1, 0, consumer=C, lease_s=60)
    assert d.groups[0].group_id == g.group_id
    assert b.ack(C, a.lease_ids).retired == 0  # 1 acked + 1 outstanding: held, still stored
    assert b.stats().size == 1 and _payload_exists(raw, keys, g)
    assert b.ack(C, d.lease_ids).retired == 1  # 2 acked, none out: removed, payload deleted
    assert b.stats().size == 0 and not _payload_exists(raw, keys, g)
    assert b.stats().evicted_total == {"max_times_sampled": 1}


def test_renew_keeps_leases_and_expired_ones_go_back(env) -> None:
    make, _, _ = env
    b = make(max_times_sampled=1)
    b.insert_many([build_group(v, seed=v) for v in range(2)])
    kept = b.lease(1, 1, consumer=C, lease_s=0.3)
    lost = b.lease(1, 1, consumer="learner-1", lease_s=0.3)
    time.sleep(0.15)
    assert b.renew(C, 5.0) == 1  # learner-1 does not renew
    time.sleep(0.3)
    again = b.lease(1, 1, consumer=C, lease_s=60)  # expiry runs inside the sample script first
    assert again.groups[0].group_id == lost.groups[0].group_id
    s = b.stats()
    assert (s.redelivered_total, s.leases_outstanding) == (1, 2)
    assert b.ack("learner-1", lost.lease_ids).unknown == tuple(lost.lease_ids)  # its lease is gone
    assert b.ack(C, kept.lease_ids + again.lease_ids).acked == 2
    assert b.renew("learner-1", 5.0) == 0


def test_expiry_also_runs_inside_insert(env) -> None:
    make, _, _ = env
    b = make(max_times_sampled=1)
    b.insert(build_group(0))
    b.lease(1, 0, consumer=C, lease_s=0.05)
    time.sleep(0.1)
    b.insert(build_group(1))
    s = b.stats()
    assert (s.redelivered_total, s.leases_outstanding, s.held) == (1, 0, 0)


def test_a_restarted_consumer_acks_its_checkpoint_and_releases_the_rest(env) -> None:
    make, raw, keys = env
    first = make(max_times_sampled=1)
    groups = [build_group(v, seed=v) for v in range(6)]
    first.insert_many(groups)
    trained = first.lease(2, 5, consumer=C, lease_s=600)  # in the checkpoint
    lost = first.lease(2, 5, consumer=C, lease_s=600)  # trained after it: lost with the process
    first.close()  # the process is gone; its leases live in Redis under its name

    restarted = make(max_times_sampled=1)
    assert restarted.leases(C) == sorted(trained.lease_ids + lost.lease_ids, key=int)
    assert restarted.ack(C, trained.lease_ids).acked == 2
    assert restarted.release(C) == 2
    assert restarted.leases(C) == []
    again = restarted.sample(4, 5, timeout_s=0)
    ids = {g.group_id for g in again}
    assert {g.group_id for g in lost.groups} <= ids  # released: sampleable again
    assert not ids & {g.group_id for g in trained.groups}  # acked: gone
    assert not any(_payload_exists(raw, keys, g) for g in trained.groups)
    s = restarted.stats()
    assert s.sampled_total == 6 and s.size == 0 and s.inserted_total == 6


def test_lease_counters_are_exported_to_prometheus(env) -> None:
    make, _, _ = env
    reg = CollectorRegistry()
    b = make(registry=reg, max_times_sampled=1)
    b.insert_many([build_group(v, seed=v) for v in range(3)])
    leased = b.lease(3, 2, consumer=C, lease_s=60)
    b.ack(C, leased.lease_ids[:2])
    b.release(C)
    value = reg.get_sample_value
    assert value("offpolicy_buffer_leased_total") == 3
    assert value("offpolicy_buffer_acked_total") == 2
    assert value("offpolicy_buffer_redelivered_total") == 1
    assert value("offpolicy_buffer_samples_total") == 0  # a lease is not a consuming sample


def test_the_ratio_limiter_counts_outstanding_and_acked_uses_not_released_ones(env) -> None:
    make, _, _ = env
    b = make(samples_per_insert=1.0, error_buffer=2.0, min_size_to_sample=1, insert_timeout_s=0.05,
             max_times_sampled=1)  # fmt: skip
    b.insert_many([build_group(v, seed=v) for v in range(3)])  # limiter: inserts ahead of samples by <= 3
    leased = b.lease(3, 2, consumer=C, lease_s=60)
    assert len(b.insert_many([build_group(v, seed=10 + v) for v in range(3)]).inserted) == 3
    b.release(C, leased.lease_ids)  # those uses go back: inserts are ahead again
    with pytest.raises(RateLimited):
        b.insert_many([build_group(0, seed=20)])


def test_the_async_buffer_leases_and_acks(any_redis, run_id) -> None:
    async def go() -> tuple:
        async with AsyncReplayBuffer(any_redis.url, run_id, BufferConfig(**FAST)) as b:
            await b.insert_many([build_group(v, seed=v) for v in range(2)])
            leased = await b.lease(2, 1, consumer=C, lease_s=60)
            renewed = await b.renew(C, 60)
            acked = await b.ack(C, leased.lease_ids[:1])
            released = await b.release(C)
            stats = await b.stats()
            await b.clear()
            return renewed, acked.acked, released, stats

    renewed, acked, released, stats = asyncio.run(go())
    assert (renewed, acked, released) == (2, 1, 1)
    assert (stats.size, stats.acked_total, stats.redelivered_total) == (1, 1, 1)


def test_bad_consumer_names_are_refused(env) -> None:
    make, _, _ = env
    b = make()
    b.insert(build_group(0))
    with pytest.raises(ValueError, match="consumer"):
        b.lease(1, 0, consumer="a b", lease_s=1)
    with pytest.raises(ValueError, match="lease_s"):
        b.lease(1, 0, consumer=C, lease_s=0)


def test_concurrent_consumers_never_lease_a_queue_group_twice(env) -> None:
    make, _, _ = env
    make(max_times_sampled=1).insert_many([build_group(0, n=1, tokens=2, seed=i) for i in range(200)])
    taken: dict[str, list[str]] = {}

    def consume(name: str) -> None:
        b = make(max_times_sampled=1)
        mine = taken.setdefault(name, [])
        while True:
            try:
                leased = b.lease(5, 0, consumer=name, lease_s=60, timeout_s=0)
            except BufferNotReady:
                return
            mine += [g.group_id for g in leased.groups]
            b.ack(name, leased.lease_ids)

    threads = [threading.Thread(target=consume, args=(f"learner-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [gid for mine in taken.values() for gid in mine]
    assert len(ids) == len(set(ids)) == 200
    s = make().stats()
    assert (s.size, s.leased_total, s.acked_total, s.sampled_total) == (0, 200, 200, 200)


def test_a_group_that_turns_stale_while_leased(env) -> None:
    make, raw, keys = env
    b = make(max_times_sampled=1, max_staleness=2)
    old, acked = build_group(0, seed=0), build_group(0, seed=1)
    b.insert_many([old, acked])
    leased = b.lease(2, 0, consumer=C, lease_s=60)
    b.insert(build_group(10, seed=2))
    assert [g.policy_version for g in b.sample(1, 10, timeout_s=0)] == [10]  # the leased ones: not dropped
    assert b.stats().dropped_total == {}
    by_gid = dict(zip((g.group_id for g in leased.groups), leased.lease_ids, strict=True))
    assert b.ack(C, [by_gid[acked.group_id]]).acked == 1  # the ack still counts
    assert b.release(C) == 1  # back to the buffer ...
    with pytest.raises(BufferNotReady):
        b.sample(1, 10, timeout_s=0)  # ... where the staleness gate drops it
    s = b.stats()
    assert s.dropped_total == {"stale": 1} and s.size == 0 and s.sampled_total == 2
    assert not raw.exists(keys.payload(old.group_id))


def test_replay_a_group_evicted_while_leased_only_counts_the_ack(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_times_sampled=None, max_size=1)
    first = build_group(0, seed=0)
    b.insert(first)
    leased = b.lease(1, 0, consumer=C, lease_s=60)  # replay: still indexed, evictable
    b.insert(build_group(0, seed=1))  # evicts `first` past max_size
    assert not raw.exists(keys.payload(first.group_id))
    acked = b.ack(C, leased.lease_ids)
    assert (acked.acked, acked.retired, acked.unknown) == (1, 0, ())
    s = b.stats()
    assert (s.size, s.acked_total, s.leases_outstanding, s.evicted_total) == (1, 1, 0, {"max_size": 1})
    assert raw.hlen(keys.uses) == 0  # nothing counted for a group that is gone
