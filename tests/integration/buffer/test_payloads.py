"""Payload keys outside Lua: a payload key exists exactly while its group is stored (inserts SET NX and
the script deletes what it refuses; samples move or copy payloads to per-call out keys that the same
transaction reads and deletes), a stored payload is never overwritten, and a payload deleted behind the
buffer's back is counted, not silently lost."""

from __future__ import annotations

import pytest
import redis
from prometheus_client import CollectorRegistry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.errors import RateLimited
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}


def _names(raw: redis.Redis, prefix: str) -> set[str]:
    return {k.decode().removeprefix(prefix) for k in raw.scan_iter(match=prefix + "*", count=1000)}


def _stored(raw: redis.Redis, keys: BufferKeys) -> set[str]:
    return {k.decode() for k in raw.zrange(keys.order, 0, -1)}


def _consistent(raw: redis.Redis, keys: BufferKeys) -> set[str]:
    """Payload keys == stored groups, none with a TTL, no out key left: return the stored ids."""
    stored = _stored(raw, keys)
    assert _names(raw, keys.payload_prefix) == stored
    assert {raw.pttl(keys.payload(gid)) for gid in stored} <= {-1}
    assert _names(raw, keys.out_prefix) == set()
    return stored


def test_a_payload_key_exists_exactly_while_its_group_is_stored(env) -> None:
    make, raw, keys = env
    b = make(samples_per_insert=1.0, error_buffer=1.0, min_size_to_sample=2, insert_timeout_s=0.05)
    good = [build_group(seed=i) for i in range(3)]
    bad = build_group(seed=9)
    bad.trajectories[1].response_ids = bad.trajectories[1].response_ids[:-1]  # invalid, mid-batch
    r = b.insert_many([good[0], bad, good[1], good[0], good[2]])  # a duplicate inside the batch too
    assert len(r.inserted) == 3 and r.duplicates == (good[0].group_id,) and list(r.rejected) == [bad.group_id]
    assert b.insert_many(good[:2]).duplicates == (good[0].group_id, good[1].group_id)
    refused = build_group(seed=5)
    with pytest.raises(RateLimited):  # diff 3 = max_diff: the limiter refuses the next insert
        b.insert(refused)
    assert _consistent(raw, keys) == {g.group_id for g in good}  # the refused group's SET NX undone
    with pytest.raises(RateLimited):  # refused, and so is the stored duplicate after it in the batch
        b.insert_many([refused, good[1]])
    assert _consistent(raw, keys) == {g.group_id for g in good}  # good[1]'s stored payload kept


def test_a_duplicate_never_overwrites_or_resurrects_a_payload(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_times_sampled=1)
    g0, g1 = build_group(seed=0), build_group(seed=1)
    b.insert_many([g0, g1])
    impostor = build_group(seed=7)
    impostor.group_id = g1.group_id  # same id, other content: still stored, must stay untouched
    assert [g.group_id for g in b.sample(1, 0, timeout_s=0)] == [g0.group_id]  # g0 consumed, removed
    r = b.insert_many([g0, impostor])  # g0's original is gone: its SET NX key must be deleted again
    assert r.duplicates == (g0.group_id, g1.group_id) and r.inserted == ()
    assert _consistent(raw, keys) == {g1.group_id}
    (out,) = b.sample(1, 0, timeout_s=0)
    assert out.group_id == g1.group_id
    assert out.trajectories[0].response_ids.tolist() == g1.trajectories[0].response_ids.tolist()
    assert _consistent(raw, keys) == set()


def test_insert_and_sample_after_script_cache_flush(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_times_sampled=1)
    b.insert(build_group(seed=0))
    raw.script_flush()  # as after a restart: EVALSHA inside the transaction gets NOSCRIPT
    assert b.insert(build_group(seed=1)) is True
    assert b.stats().inserted_total == 2
    assert len(_consistent(raw, keys)) == 2
    raw.script_flush()
    assert len(b.sample(2, 0, timeout_s=0)) == 2
    assert b.stats().sampled_total == 2  # the transaction that hit NOSCRIPT sampled nothing
    assert _consistent(raw, keys) == set()


def test_removed_payloads_are_deleted_at_once(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_times_sampled=2, max_staleness=1, max_size=2)
    g0, g1, g2, g3, g4 = (build_group(v, seed=i) for i, v in enumerate((0, 2, 2, 2, 2)))
    b.insert_many([g0, g1])
    assert [g.group_id for g in b.sample(1, 2, timeout_s=0)] == [g1.group_id]  # g0 dropped stale
    assert _consistent(raw, keys) == {g1.group_id}  # 1st use: the payload was copied out, kept
    assert [g.group_id for g in b.sample(1, 2, timeout_s=0)] == [g1.group_id]  # g1 removed: 2nd use
    b.insert_many([g2, g3, g4])  # max_size 2: g2 evicted
    assert _consistent(raw, keys) == {g3.group_id, g4.group_id}
    s = b.stats()
    assert (s.size, s.dropped_total, s.evicted_total) == (
        2, {"stale": 1, "evicted_unsampled": 1}, {"max_times_sampled": 1, "max_size": 1}
    )  # fmt: skip


def test_payload_deleted_behind_the_buffers_back_is_counted_and_the_rest_returned(env) -> None:
    make, raw, keys = env
    reg = CollectorRegistry()
    b = make(reg, sampler="fifo", max_times_sampled=None)
    groups = [build_group(v, seed=v) for v in range(3)]
    b.insert_many(groups)
    raw.delete(keys.payload(groups[1].group_id))  # as a maxmemory policy or an operator could
    out = b.sample(3, 2, timeout_s=0)
    assert [g.group_id for g in out] == [groups[0].group_id, groups[2].group_id]
    s = b.stats()
    assert (s.sampled_total, s.dropped_total) == (3, {"payload_missing": 1})
    assert reg.get_sample_value("offpolicy_buffer_drops_total", {"reason": "payload_missing"}) == 1
    assert reg.get_sample_value("offpolicy_buffer_samples_total") == 2
    assert _names(raw, keys.out_prefix) == set()


def test_when_every_chosen_payload_is_missing_sample_chooses_again(env) -> None:
    make, raw, keys = env
    reg = CollectorRegistry()
    b = make(reg, sampler="fifo", max_times_sampled=1)
    groups = [build_group(v, seed=v) for v in range(2)]
    b.insert_many(groups)
    raw.delete(keys.payload(groups[0].group_id))
    assert [g.group_id for g in b.sample(1, 1, timeout_s=1)] == [groups[1].group_id]
    assert b.stats().dropped_total == {"payload_missing": 1}
    assert reg.get_sample_value("offpolicy_buffer_rate_limited_waits_total", {"op": "sample"}) == 1
    assert _consistent(raw, keys) == set()


async def test_async_payload_protocol(any_redis, run_id) -> None:
    keys = BufferKeys.for_run(run_id)
    async with AsyncReplayBuffer(any_redis.url, run_id, BufferConfig(max_times_sampled=2)) as b:
        groups = [build_group(v, seed=v) for v in range(2)]
        assert len((await b.insert_many([*groups, groups[0]])).inserted) == 2
        assert [g.group_id for g in await b.sample(2, 1, timeout_s=0)] == [g.group_id for g in groups]
        assert [g.group_id for g in await b.sample(1, 1, timeout_s=0)] == [groups[0].group_id]
        with redis.Redis.from_url(any_redis.url) as raw:
            assert _consistent(raw, keys) == {groups[1].group_id}  # groups[0]: 2nd use, gone
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
    assert _consistent(raw, keys) == {groups[3].group_id, groups[4].group_id}
    assert [g.policy_version for g in b.sample(2, 4, timeout_s=0)] == [3, 4]


def test_lowering_max_size_evicts_thousands_of_groups_in_one_insert(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_size=10_000, max_times_sampled=None)
    b.insert_many([build_group(v, n=1, tokens=2, seed=v) for v in range(8200)])
    b.reconfigure(b.config.model_copy(update={"max_size": 10}))
    last = build_group(8200, n=1, tokens=2)
    assert b.insert(last) is True  # evicts 8191 groups at once: more than Lua's unpack takes (8000)
    s = b.stats()
    assert (s.size, s.evicted_total, s.dropped_total) == (10, {"max_size": 8191}, {"evicted_unsampled": 8191})
    assert (s.policy_version_min, s.policy_version_max) == (8191, 8200)
    assert len(_consistent(raw, keys)) == 10
    assert raw.zcard(keys.by_version) == 10


def test_sampling_thousands_of_groups_in_one_call(env) -> None:
    make, raw, keys = env
    b = make(sampler="fifo", max_size=20_000, max_times_sampled=2)
    groups = [build_group(v, n=1, tokens=2, seed=v) for v in range(8200)]
    b.insert_many(groups)
    for _ in range(2):  # 1st use counts 8200 uses, 2nd removes them: more than Lua's unpack takes (8000)
        out = b.sample(8200, 0, timeout_s=0)
        assert [g.group_id for g in out] == [g.group_id for g in groups]
    s = b.stats()
    assert (s.size, s.sampled_total, s.evicted_total) == (0, 16400, {"max_times_sampled": 8200})
    assert _consistent(raw, keys) == set() and raw.hlen(keys.uses) == 0
