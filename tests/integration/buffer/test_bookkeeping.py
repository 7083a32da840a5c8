"""Bounded bookkeeping on Redis 6.2 and 7.x: the dedupe window (count, age), the weighted samplers'
exact distribution without sorting the index, and the stale drop in bounded chunks."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import redis

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.storage import script_source
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}


@pytest.fixture
def buf(any_redis, run_id):
    made = []

    def make(**cfg) -> ReplayBuffer:
        b = ReplayBuffer(any_redis.url, f"{run_id}-{len(made)}", BufferConfig(**{**FAST, **cfg}))
        made.append(b)
        return b

    yield make
    for b in made:
        b.clear()
        b.close()


def _seen(url: str, b: ReplayBuffer) -> int:
    """Entries in the dedupe window of `b`."""
    with redis.Redis.from_url(url) as c:
        return c.zcard(BufferKeys.for_run(b.run_id).seen)


def test_dedupe_window_by_count(buf, any_redis) -> None:
    b = buf(dedupe_window=3, max_times_sampled=1)
    groups = [build_group(v, seed=v) for v in range(5)]
    b.insert_many(groups)
    assert _seen(any_redis.url, b) == 3  # bounded
    b.sample(5, 4, timeout_s=0)  # consumed: no longer stored
    assert b.insert(groups[4]) is False  # still in the window: a duplicate
    assert b.insert(groups[0]) is True  # left the window: stored again (the documented consequence)
    assert b.stats().inserted_total == 6


def test_a_stored_group_is_a_duplicate_outside_the_window(buf) -> None:
    b = buf(dedupe_window=1, max_times_sampled=1)
    old, new = build_group(0, seed=0), build_group(0, seed=1)
    b.insert_many([old, new])
    assert b.insert(old) is False  # out of the window, still stored
    assert b.stats().size == 2 and b.stats().duplicates_total == 1


def test_dedupe_window_by_age(buf, any_redis) -> None:
    b = buf(dedupe_window=None, dedupe_window_s=0.2, max_times_sampled=1)
    first = build_group(0, seed=0)
    b.insert(first)
    b.sample(1, 0, timeout_s=0)
    assert b.insert(first) is False
    time.sleep(0.3)
    b.insert(build_group(0, seed=1))  # trims the window
    assert _seen(any_redis.url, b) == 1
    assert b.insert(first) is True


def _inclusion(weights: list[float], k: int) -> list[float]:
    """Exact probability that each item is among k picks of successive weighted sampling."""
    n, out = len(weights), [0.0] * len(weights)
    for order in itertools.permutations(range(n), k):
        p, left = 1.0, sum(weights)
        for i in order:
            p *= weights[i] / left
            left -= weights[i]
        for i in order:
            out[i] += p
    return out


def _check(counts: Counter, expect: list[float], draws: int) -> None:
    for i, p in enumerate(expect):
        sd = (draws * p * (1 - p)) ** 0.5
        assert abs(counts[i] - draws * p) < 4.5 * sd + 2, (i, counts[i], draws * p)


def test_prioritized_is_exact_weighted_sampling_without_replacement(buf) -> None:
    priorities = [0.0, 0.05, 0.3, 1.0, 2.5, 9.0]  # weights p + 0.01 span 10 power-of-2 bands
    b = buf(sampler="prioritized", max_times_sampled=None, priority_epsilon=0.01)
    b.insert_many([build_group(i, priority=p, seed=i) for i, p in enumerate(priorities)])
    draws = 2000
    counts = Counter(g.policy_version for _ in range(draws) for g in b.sample(2, 0, timeout_s=0))
    _check(counts, _inclusion([p + 0.01 for p in priorities], 2), draws)


def test_prioritized_zero_weights_come_last(buf) -> None:
    b = buf(sampler="prioritized", max_times_sampled=None, priority_epsilon=0.0)
    b.insert_many([build_group(i, priority=p, seed=i) for i, p in enumerate([0.0, 0.0, 3.0])])
    for _ in range(50):
        picked = sorted(g.policy_version for g in b.sample(2, 0, timeout_s=0))
        assert 2 in picked  # the one positive weight is always picked before any zero weight


def test_staleness_weighted_is_exact_weighted_sampling_without_replacement(buf) -> None:
    versions = [0, 3, 6, 8, 9, 10, 12]  # consumer 10: staleness 10, 7, 4, 2, 1, 0, -2 (future: weight 1)
    b = buf(sampler="staleness_weighted", max_times_sampled=None)
    b.insert_many([build_group(v, seed=i) for i, v in enumerate(versions)])
    draws = 2000
    picks = Counter(g.policy_version for _ in range(draws) for g in b.sample(3, 10, timeout_s=0))
    weights = [1 / (max(10 - v, 0) + 1) for v in versions]
    _check(Counter({i: picks[v] for i, v in enumerate(versions)}), _inclusion(weights, 3), draws)


SLOWLOG_LEN = 10_000  # Redis 6.2 also logs each command a script runs: ~30 entries per sample call


@contextmanager
def _slowlog_everything(c: redis.Redis, max_len: int = SLOWLOG_LEN) -> Iterator[None]:
    """Log every command the server runs (with its execution time) while inside; restore the settings.
    The sample script is loaded first: no NOSCRIPT attempt (a failed EVALSHA) is logged as a call."""
    c.script_load(script_source("sample"))
    before = c.config_get("slowlog-*")
    c.config_set("slowlog-log-slower-than", 0)
    c.config_set("slowlog-max-len", max_len)
    c.slowlog_reset()
    try:
        yield
    finally:
        c.config_set("slowlog-log-slower-than", before["slowlog-log-slower-than"])
        c.config_set("slowlog-max-len", before["slowlog-max-len"])


def _script_us(c: redis.Redis, b: ReplayBuffer, max_len: int = SLOWLOG_LEN) -> list[int]:
    """Server-side durations (µs) of `b`'s script calls in the slowlog, oldest first. Filtered by the
    run's hash tag in the keys: other clients of the shared server log there too."""
    tag = f"{{{b.run_id}}}".encode()
    return [
        e["duration"]
        for e in reversed(c.slowlog_get(max_len))
        if e["command"].split()[0].upper() in (b"EVALSHA", b"EVAL") and tag in e["command"]
    ]


@pytest.mark.parametrize("sampler", ["staleness_weighted", "prioritized", "uniform"])
def test_samplers_do_not_read_the_whole_index(buf, any_redis, sampler) -> None:
    """Sampling 4 of 20000 groups costs about what sampling 4 of 200 does (reading and sorting the
    index, as the samplers did before, makes it ~100x slower). Measured on the server (the script's
    execution time in the slowlog, not the client's round trip) with the two buffers' calls interleaved,
    so that a busy client machine or a slow moment of the server hits both alike."""

    def filled(n: int) -> ReplayBuffer:
        b = buf(sampler=sampler, max_times_sampled=None, max_size=n)
        rng = np.random.default_rng(0)
        groups = [build_group(int(v), n=1, tokens=1, priority=float(p), seed=1)
                  for v, p in zip(rng.integers(0, 50, n), rng.random(n), strict=True)]  # fmt: skip
        b.insert_many(groups)
        return b

    small, large = filled(200), filled(20_000)
    calls = 21
    with redis.Redis.from_url(any_redis.url) as c, _slowlog_everything(c):
        for _ in range(calls):
            for b in (small, large):
                assert len(b.sample(4, 50, timeout_s=0)) == 4
        small_us, large_us = _script_us(c, small), _script_us(c, large)
    assert (len(small_us), len(large_us)) == (calls, calls)  # one script call per sample
    small_p50, large_p50 = statistics.median(small_us), statistics.median(large_us)
    assert large_p50 < 3 * small_p50 + 300, (small_us, large_us)


def test_stale_groups_are_dropped_in_bounded_chunks(buf, any_redis) -> None:
    b = buf(max_staleness=2, max_times_sampled=1)
    b.insert_many([build_group(0, n=1, tokens=1, seed=i) for i in range(4500)])
    b.insert_many([build_group(10, seed=1)])
    with redis.Redis.from_url(any_redis.url) as c, _slowlog_everything(c):
        got = b.sample(1, 10, timeout_s=0)
        evals = _script_us(c, b)
    assert [g.policy_version for g in got] == [10]
    assert b.stats().dropped_total == {"stale": 4500}
    assert len(evals) == 3  # 2000 + 2000 + 500: three script calls of this run
