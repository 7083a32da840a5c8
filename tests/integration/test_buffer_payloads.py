"""Payload keys outside Lua: staging keys never outlive an insert, removed payloads expire after the
grace (or at once when the sampler owns them), and a payload gone before the fetch is counted."""

from __future__ import annotations

import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from buffer.config import BufferConfig
from buffer.errors import RateLimited
from buffer.keys import BufferKeys
from buffer.replay_buffer import AsyncReplayBuffer, ReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}


@pytest.fixture
def env(any_redis, run_id):
    """(make buffer, raw client, keys) on Redis 6.2 and 7.x."""
    made = []
    raw = redis.Redis.from_url(any_redis.url)

    def make(registry=None, **cfg) -> ReplayBuffer:
        b = ReplayBuffer(any_redis.url, run_id, BufferConfig(**{**FAST, **cfg}), registry)
        made.append(b)
        return b

    yield make, raw, BufferKeys.for_run(run_id)
    for b in made:
        b.clear()
        b.close()
    raw.close()


def _names(raw: redis.Redis, prefix: str) -> set[str]:
    return {k.decode().removeprefix(prefix) for k in raw.scan_iter(match=prefix + "*", count=1000)}


def test_staging_keys_never_left_behind(env) -> None:
    make, raw, keys = env
    b = make(samples_per_insert=1.0, error_buffer=1.0, min_size_to_sample=2, insert_timeout_s=0.05)
    good = [build_group(seed=i) for i in range(3)]
    bad = build_group(seed=9)
    bad.trajectories[1].response_ids = bad.trajectories[1].response_ids[:-1]  # invalid, mid-batch
    r = b.insert_many([good[0], bad, good[1], good[0], good[2]])  # a duplicate inside the batch too
    assert len(r.inserted) == 3 and r.duplicates == (good[0].group_id,) and list(r.rejected) == [bad.group_id]
    assert b.insert_many(good[:2]).duplicates == (good[0].group_id, good[1].group_id)
    with pytest.raises(RateLimited):  # diff 3 = max_diff: the limiter refuses the next insert
        b.insert(build_group(seed=5))
    assert _names(raw, keys.staging_prefix) == set()
    assert _names(raw, keys.payload_prefix) == {g.group_id for g in good}
    assert {raw.pttl(keys.payload(g.group_id)) for g in good} == {-1}  # no TTL on stored payloads


def test_insert_after_script_cache_flush(env) -> None:
    make, raw, keys = env
    b = make()
    b.insert(build_group(seed=0))
    raw.script_flush()  # as after a restart: EVALSHA inside the transaction gets NOSCRIPT
    assert b.insert(build_group(seed=1)) is True
    assert b.stats().inserted_total == 2
    assert _names(raw, keys.staging_prefix) == set() and len(_names(raw, keys.payload_prefix)) == 2


def test_removed_payloads_expire_after_the_grace(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_times_sampled=2, max_staleness=1, max_size=2, retired_payload_grace_s=0.3)
    g0, g1, g2, g3, g4 = (build_group(v, seed=i) for i, v in enumerate((0, 2, 2, 2, 2)))
    b.insert_many([g0, g1])
    assert [g.group_id for g in b.sample(1, 2, timeout_s=0)] == [g1.group_id]  # g0 dropped stale
    assert [g.group_id for g in b.sample(1, 2, timeout_s=0)] == [g1.group_id]  # g1 removed: 2nd use
    b.insert_many([g2, g3, g4])  # max_size 2: g2 evicted
    for g in (g0, g1, g2):  # out of every index, payload kept for the grace
        assert 0 < raw.pttl(keys.payload(g.group_id)) <= 300
    assert raw.pttl(keys.payload(g3.group_id)) == -1
    s = b.stats()
    assert (s.size, s.dropped_total, s.evicted_total) == (
        2, {"stale": 1, "evicted_unsampled": 1}, {"max_times_sampled": 1, "max_size": 1}
    )  # fmt: skip
    time.sleep(0.4)
    assert _names(raw, keys.payload_prefix) == {g3.group_id, g4.group_id}


def test_payload_owned_by_its_only_sampler_is_deleted_at_once(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_times_sampled=1)
    g = build_group(seed=0)
    b.insert_many([g, build_group(seed=1)])
    assert b.sample(1, 0, timeout_s=0)[0].group_id == g.group_id
    assert raw.exists(keys.payload(g.group_id)) == 0  # removed at its first use: nobody else chose it
    assert len(_names(raw, keys.payload_prefix)) == 1


def test_payload_gone_before_fetch_is_counted_and_the_rest_returned(env) -> None:
    make, raw, keys = env
    reg = CollectorRegistry()
    b = make(reg, sampler="fifo", max_times_sampled=None)
    groups = [build_group(v, seed=v) for v in range(3)]
    b.insert_many(groups)
    # A consumer stalled past the grace: its chosen group's payload expired before its MGET. Expire it
    # in Redis, as the grace would have.
    raw.pexpire(keys.payload(groups[1].group_id), 1)
    time.sleep(0.01)
    out = b.sample(3, 2, timeout_s=0)
    assert [g.group_id for g in out] == [groups[0].group_id, groups[2].group_id]
    s = b.stats()
    assert (s.sampled_total, s.dropped_total) == (3, {"expired_before_fetch": 1})
    assert reg.get_sample_value("offpolicy_buffer_drops_total", {"reason": "expired_before_fetch"}) == 1
    assert reg.get_sample_value("offpolicy_buffer_samples_total") == 2


async def test_async_payload_protocol(any_redis, run_id) -> None:
    keys = BufferKeys.for_run(run_id)
    async with AsyncReplayBuffer(any_redis.url, run_id, BufferConfig(max_times_sampled=2)) as b:
        groups = [build_group(v, seed=v) for v in range(2)]
        assert len((await b.insert_many([*groups, groups[0]])).inserted) == 2
        assert [g.group_id for g in await b.sample(2, 1, timeout_s=0)] == [g.group_id for g in groups]
        assert [g.group_id for g in await b.sample(1, 1, timeout_s=0)] == [groups[0].group_id]
        with redis.Redis.from_url(any_redis.url) as raw:
            assert _names(raw, keys.staging_prefix) == set()
            assert raw.pttl(keys.payload(groups[0].group_id)) > 0  # 2nd use: removed, in its grace
            assert raw.pttl(keys.payload(groups[1].group_id)) == -1
            await b.clear()
            assert _names(raw, keys.payload_prefix) == set()


def test_batch_larger_than_max_size_evicts_its_own_oldest(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_size=2, max_times_sampled=None)
    groups = [build_group(v, seed=v) for v in range(5)]
    r = b.insert_many([*groups, groups[4]])
    assert len(r.inserted) == 5 and r.duplicates == (groups[4].group_id,)
    s = b.stats()
    assert (s.size, s.evicted_total, s.dropped_total) == (2, {"max_size": 3}, {"evicted_unsampled": 3})
    assert [g.policy_version for g in b.sample(2, 4, timeout_s=0)] == [3, 4]
    assert {raw.pttl(keys.payload(g.group_id)) > 0 for g in groups[:3]} == {True}  # in their grace
    assert _names(raw, keys.staging_prefix) == set()


def test_when_every_chosen_payload_expired_sample_chooses_again(env) -> None:
    make, raw, keys = env
    reg = CollectorRegistry()
    b = make(reg, sampler="fifo", max_times_sampled=1)
    groups = [build_group(v, seed=v) for v in range(2)]
    b.insert_many(groups)
    raw.pexpire(keys.payload(groups[0].group_id), 1)  # as if the grace had run out before the fetch
    time.sleep(0.01)
    assert [g.group_id for g in b.sample(1, 1, timeout_s=1)] == [groups[1].group_id]
    assert b.stats().dropped_total == {"expired_before_fetch": 1}
    assert reg.get_sample_value("offpolicy_buffer_rate_limited_waits_total", {"op": "sample"}) == 1
