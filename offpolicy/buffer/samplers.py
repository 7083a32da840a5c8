"""The sampler rules (implemented atomically in scripts/samplers.lua) and the priority of a group.

Every sampler first drops groups with `policy_version < consumer_version - max_staleness` (at most 2000
per script call; with more, the script answers "again" and the client calls once more at once), then
chooses `k` distinct groups among the sampleable ones (stored, and acked uses + outstanding leases <
`max_times_sampled`):

- `fifo`: the `k` oldest by insert order (a queue). `ZRANGE 0 k-1`: O(log N + k).
- `newest`: the `k` most recently inserted. `ZREVRANGE 0 k-1`: O(log N + k).
- `uniform`: `k` distinct groups, each subset equally likely (Floyd's algorithm over insert ranks, one
  `ZRANGE i i` per pick): O(k log N).
- `staleness_weighted`: without replacement, weight `1 / (max(consumer_version - policy_version, 0) + 1)`.
- `prioritized`: without replacement, weight `priority + priority_epsilon`.

The two weighted samplers are exact successive sampling (each pick has probability weight / total weight
of the groups not yet picked: the distribution of Efraimidis-Spirakis keys, which the scripts used to
compute for every stored group and sort). Nothing reads or sorts the index: the sorted set (by
`policy_version`, or by priority) is cut into score bands within which weights differ by at most 2x
(`staleness_weighted`: band 0 = staleness <= 0, band j = staleness in [2^(j-1), 2^j - 1]; `prioritized`:
weight in [2^b, 2^(b+1)), at most 64 bands, the lowest one open downwards). A pick proposes a band with
probability `left_j * m_j / sum(left * m)` (`m_j` the band's largest weight, `left_j` its groups not yet
picked), a uniform not-yet-picked rank in it (a sparse Fisher-Yates table: no duplicate draws), reads that
one member (`ZRANGE i i WITHSCORES`) and accepts it with probability `weight / m_j >= 1/2`. Cost: one
`ZCOUNT` per band, then O(log N) per proposal, < 2 proposals per pick on average: O((B + k) log N) with
B <= 64 bands. No approximation: when only zero-weight groups are left (`priority_epsilon` 0), they are
picked uniformly, as their -inf keys would be.

The random seed comes from the client on each call (Redis 6.2 reseeds the script PRNG identically on
every call, so without it every sample would draw the same numbers).
"""

from __future__ import annotations

import numpy as np

from offpolicy.buffer.types import TrajectoryGroup


def group_priority(group: TrajectoryGroup) -> float:
    """The producer's `priority`, else the |advantage| proxy: mean |reward - group mean reward|."""
    if group.priority is not None:
        return group.priority
    rewards = np.array([t.reward for t in group.trajectories], dtype=np.float64)
    return float(np.abs(rewards - rewards.mean()).mean())
