"""Priorities the learner keeps current, on Redis 6.2 and 7.x: `priority_alpha` gives the exact
distribution of weights (priority + eps)^alpha, `ack` writes new priorities atomically with the
acknowledgement (indexed and held groups; retired ones left alone), and `priorities` reads them back."""

from __future__ import annotations

from collections import Counter

import pytest

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.leases import ack_args
from offpolicy.buffer.replay_buffer import ReplayBuffer
from tests.conftest import build_group
from tests.integration.buffer.test_bookkeeping import _check, _inclusion

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}
C = "learner-0"


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


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_priority_alpha_is_exact_weighted_sampling(buf, alpha: float) -> None:
    priorities = [0.0, 0.05, 0.3, 1.0, 2.5, 9.0]
    b = buf(sampler="prioritized", max_times_sampled=None, priority_epsilon=0.01, priority_alpha=alpha)
    b.insert_many([build_group(i, priority=p, seed=i) for i, p in enumerate(priorities)])
    draws = 2000
    counts = Counter(g.policy_version for _ in range(draws) for g in b.sample(2, 0, timeout_s=0))
    _check(counts, _inclusion([(p + 0.01) ** alpha for p in priorities], 2), draws)


def test_priority_alpha_zero_is_uniform(buf) -> None:
    b = buf(sampler="prioritized", max_times_sampled=None, priority_epsilon=0.0, priority_alpha=0.0)
    b.insert_many([build_group(i, priority=p, seed=i) for i, p in enumerate([0.0, 1.0, 100.0])])
    draws = 1500
    counts = Counter(g.policy_version for _ in range(draws) for g in b.sample(1, 0, timeout_s=0))
    _check(counts, [1 / 3] * 3, draws)


def test_ack_writes_priorities_of_groups_that_stay(buf) -> None:
    b = buf(sampler="prioritized", max_times_sampled=2, priority_epsilon=0.0)
    groups = [build_group(i, priority=1.0, seed=i) for i in range(3)]
    b.insert_many(groups)
    first = b.lease(3, 0, consumer=C, lease_s=60)
    ids = {g.group_id: lid for g, lid in zip(first.groups, first.lease_ids, strict=True)}
    g0, g1, g2 = (g.group_id for g in groups)
    again = b.lease(1, 0, consumer=C, lease_s=60)  # one group leased twice: held (uses + leases = 2)
    held = again.groups[0].group_id
    assert b.stats().held == 1
    acked = b.ack(C, [ids[g0], ids[g1], ids[g2]], [5.0, None, 0.25])
    assert acked.acked == 3 and acked.retired == 0
    got = dict(zip([g0, g1, g2], b.priorities([g0, g1, g2]), strict=True))
    assert got == {g0: 5.0, g1: 1.0, g2: 0.25}  # indexed or held alike; None leaves it
    assert b.stats().held == 1  # the ack changed priorities, not who is sampleable
    done = b.ack(C, again.lease_ids, [7.0])  # its last use: retired, nothing to re-prioritise
    assert done.retired == 1 and b.priorities([held]) == [None]
    counters = BufferKeys.for_run(b.run_id).counters
    assert int(b._client.hget(counters, "reprioritized")) == 2


def test_ack_priorities_apply_only_to_the_consumers_leases(buf) -> None:
    b = buf(sampler="prioritized", max_times_sampled=None, priority_epsilon=0.0)
    g = build_group(0, priority=1.0)
    b.insert(g)
    leased = b.lease(1, 0, consumer=C, lease_s=60)
    assert b.ack("someone-else", leased.lease_ids, [9.0]).unknown == tuple(leased.lease_ids)
    assert b.priorities([g.group_id]) == [1.0]
    b.ack(C, leased.lease_ids, [3.0])
    assert b.priorities([g.group_id]) == [3.0]
    assert b.ack(C, leased.lease_ids, [8.0]).unknown == tuple(leased.lease_ids)  # acked twice: no-op
    assert b.priorities([g.group_id]) == [3.0]


def test_groups_without_a_priority_keep_none(buf) -> None:
    b = buf(sampler="fifo", max_times_sampled=None)
    g = build_group(0)
    b.insert(g)
    leased = b.lease(1, 0, consumer=C, lease_s=60)
    assert b.ack(C, leased.lease_ids, [4.0]).acked == 1
    assert b.priorities([g.group_id]) == [None]


def test_ack_args_check_priorities() -> None:
    cfg, keys = BufferConfig(), BufferKeys.for_run("r")
    assert ack_args(cfg, keys, C, ["1", "2"], [0.5, None])[-4:] == ["1", "0.5", "2", ""]
    with pytest.raises(ValueError, match="2 priorities for 1"):
        ack_args(cfg, keys, C, ["1"], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite number"):
        ack_args(cfg, keys, C, ["1"], [float("nan")])
