"""The Lua scripts on Redis 6.2 and 7.x: each sampler's rule, remover, staleness, eviction, dedupe."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.replay_buffer import ReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis


@pytest.fixture
def buf(any_redis, run_id):
    buffers = []

    def make(**cfg) -> ReplayBuffer:
        b = ReplayBuffer(any_redis.url, f"{run_id}-{len(buffers)}", BufferConfig(**cfg))
        buffers.append(b)
        return b

    yield make
    for b in buffers:
        b.clear()
        b.close()


def _versions(groups) -> list[int]:
    return [g.policy_version for g in groups]


def test_fifo_and_newest_order(buf) -> None:
    for sampler, expect in (("fifo", [[0, 1], [2, 3]]), ("newest", [[4, 3], [2, 1]])):
        b = buf(sampler=sampler)
        b.insert_many([build_group(v) for v in range(5)])
        assert [_versions(b.sample(2, 4, timeout_s=0)) for _ in range(2)] == expect


def test_uniform_is_uniform_and_reseeded_per_call(buf) -> None:
    b = buf(sampler="uniform", max_times_sampled=None)
    b.insert_many([build_group(v) for v in range(4)])
    draws = [b.sample(2, 3, timeout_s=0) for _ in range(600)]
    assert all(len({g.group_id for g in d}) == 2 for d in draws)  # distinct within a sample
    counts = Counter(v for d in draws for v in _versions(d))
    # each version is in half of the 600 samples: 300, sd ~12; a fixed PRNG seed would give one pair always
    assert all(240 <= counts[v] <= 360 for v in range(4)), counts
    assert len({tuple(sorted(_versions(d))) for d in draws}) == 6


def test_staleness_weighted_rule(buf) -> None:
    b = buf(sampler="staleness_weighted", max_times_sampled=None, max_staleness=3)
    b.insert_many([build_group(v) for v in range(4)])  # staleness at consumer 3: 3, 2, 1, 0
    counts = Counter(_versions([g for _ in range(1500) for g in b.sample(1, 3, timeout_s=0)]))
    weights = np.array([1 / 4, 1 / 3, 1 / 2, 1])
    expect = 1500 * weights / weights.sum()  # 180, 240, 360, 720
    for v in range(4):
        sd = (expect[v] * (1 - expect[v] / 1500)) ** 0.5
        assert abs(counts[v] - expect[v]) < 5 * sd, (counts, expect)


def test_prioritized_rule(buf) -> None:
    b = buf(sampler="prioritized", max_times_sampled=None, priority_epsilon=0.0)
    b.insert_many([build_group(0, priority=0.0), build_group(1, priority=1.0), build_group(2, priority=3.0)])
    # default priority = mean |r - mean r|: rewards [0, 0, 0, 4] -> mean 1 -> (1+1+1+3)/4 = 1.5
    b.insert(build_group(3, rewards=[0.0, 0.0, 0.0, 4.0]))
    counts = Counter(_versions([g for _ in range(1100) for g in b.sample(1, 3, timeout_s=0)]))
    assert counts[0] == 0  # zero priority, no epsilon: never
    expect = {1: 200, 2: 600, 3: 300}  # 1 : 3 : 1.5 of 1100
    for v, e in expect.items():
        assert abs(counts[v] - e) < 5 * (e * (1 - e / 1100)) ** 0.5, counts


def test_max_times_sampled_removes(buf) -> None:
    b = buf(sampler="fifo", max_times_sampled=2)
    b.insert_many([build_group(v) for v in range(2)])
    assert _versions(b.sample(1, 0, timeout_s=0)) == [0]
    assert _versions(b.sample(1, 0, timeout_s=0)) == [0]
    assert _versions(b.sample(1, 0, timeout_s=0)) == [1]
    s = b.stats()
    assert (s.size, s.sampled_total, s.evicted_total) == (1, 3, {"max_times_sampled": 1})


def test_max_staleness_drops_and_counts(buf) -> None:
    b = buf(sampler="fifo", max_staleness=2, max_times_sampled=None)
    b.insert_many([build_group(v) for v in range(6)])
    out = b.sample(3, 5, timeout_s=0)  # versions < 3 are too stale for consumer 5
    assert _versions(out) == [3, 4, 5]
    s = b.stats()
    assert (s.size, s.dropped_total, s.policy_version_min) == (3, {"stale": 3}, 3)


def test_eviction_oldest_first_and_counted(buf) -> None:
    b = buf(sampler="fifo", max_size=3, max_times_sampled=None)
    groups = [build_group(v) for v in range(5)]
    b.insert_many(groups[:2])
    b.sample(1, 0, timeout_s=0)  # group 0 used once
    b.insert_many(groups[2:])
    s = b.stats()
    assert (s.size, s.inserted_total) == (3, 5)
    assert s.evicted_total == {"max_size": 2}
    assert s.dropped_total == {"evicted_unsampled": 1}  # group 1 was never sampled
    assert _versions(b.sample(3, 4, timeout_s=0)) == [2, 3, 4]


def test_duplicates_are_noops_even_after_removal(buf) -> None:
    b = buf(sampler="fifo")
    g = build_group(0)
    assert b.insert(g) is True
    assert b.insert(g) is False
    b.sample(1, 0, timeout_s=0)  # consumed and removed
    r = b.insert_many([g, build_group(1)])
    assert r.duplicates == (g.group_id,) and len(r.inserted) == 1
    s = b.stats()
    assert (s.inserted_total, s.duplicates_total, s.size) == (2, 2, 1)


def test_malformed_group_in_batch_leaves_the_rest(buf) -> None:
    b = buf(sampler="fifo")
    good = [build_group(v) for v in range(3)]
    bad = build_group(9)
    bad.trajectories[2].behavior_logprobs = bad.trajectories[2].behavior_logprobs[:-1]
    r = b.insert_many([good[0], bad, good[1], good[2]])
    assert r.inserted == tuple(g.group_id for g in good)
    assert r.rejected == {bad.group_id: "trajectories[2].behavior_logprobs"}
    assert b.stats().rejected_total == {"trajectories.behavior_logprobs": 1}
    out = b.sample(3, 2, timeout_s=0)
    np.testing.assert_array_equal(
        out[1].trajectories[0].behavior_logprobs, good[1].trajectories[0].behavior_logprobs
    )


def test_clear(buf) -> None:
    b = buf()
    b.insert(build_group(0))
    b.clear()
    s = b.stats()
    assert (s.size, s.inserted_total, s.policy_version_min) == (0, 0, None)
