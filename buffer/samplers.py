"""The sampler rules (implemented atomically in scripts/sample.lua) and the priority of a group.

Every sampler first drops groups with `policy_version < consumer_version - max_staleness`, then
chooses `k` distinct groups among the rest:

- `fifo`: the `k` oldest by insert order (a queue).
- `newest`: the `k` most recently inserted.
- `uniform`: `k` distinct groups, each subset equally likely (Floyd's algorithm over insert ranks).
- `staleness_weighted`: without replacement, weight `1 / (max(consumer_version - policy_version, 0) + 1)`.
- `prioritized`: without replacement, weight `priority + priority_epsilon`.

Weighted sampling without replacement uses Efraimidis-Spirakis keys (`log(u) / w`, largest `k`); it reads
every stored group, so it costs O(size) per call (fine up to ~1e5 groups; `fifo`/`newest`/`uniform` are
O(k log size)). The random seed comes from the client on each call (Redis 6.2 reseeds the script PRNG
identically on every call, so without it every sample would draw the same numbers).
"""

from __future__ import annotations

import numpy as np

from buffer.types import TrajectoryGroup


def group_priority(group: TrajectoryGroup) -> float:
    """The producer's `priority`, else the |advantage| proxy: mean |reward - group mean reward|."""
    if group.priority is not None:
        return group.priority
    rewards = np.array([t.reward for t in group.trajectories], dtype=np.float64)
    return float(np.abs(rewards - rewards.mean()).mean())
