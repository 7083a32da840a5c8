"""Prioritized replay kept current by the learner: the priority it writes back after training a group,
and the importance weights that undo the `prioritized` sampler's bias in the loss (`priorities` config).

The priority of a group the learner trained (or dropped), written with its acknowledgement
(learner/delivery.py, buffer/scripts/lease.lua):

    priority = mean over the group's response tokens of |A| x (1 + is_deviation) x decay^staleness

- `A`: the advantage the configured outcome estimator gives each completion from the group's rewards
  (`grpo`, with or without the std division; `rloo`; `reinforce`, its baseline taken within the group),
  broadcast over the completion's tokens as in the step, so the token mean weights each completion by
  its length. Under `gae` (a critic) the group-relative |r - mean r| stands in. A zero-variance group
  has priority 0: the sampler then draws it only through `priority_epsilon`.
- `is_deviation`: the mean |log w| over the group's kept response tokens, w = pi_old / mu the decoupled
  IS ratio of each token (how far off its behaviour policy mu was; `group_is_deviation`, carried per group
  by `StepResult`). On the log scale, so that one wild token does not swamp the group, and whether or not
  the rollout correction applies (or truncates) the weights; 0 in bypass mode (no pi_old: pi_old = mu).
- `staleness`: the learner's version after the update minus the group's `policy_version` (>= 0), the
  staleness the group would have at its next sample, decayed by `priorities.staleness_decay` per version.
  A group not trained again keeps the priority of its last training (only the learner writes them).

Importance weights (Schaul et al. 2016): P(i) = (p_i + eps)^alpha / sum_j (p_j + eps)^alpha over the
sampleable groups, w_i = (N P(i))^-beta / max_j (N P(j))^-beta. Normalised by the largest weight among
the step's groups (as the paper's implementation does, per batch), N and the sum cancel:
w_i = ((p_min + eps) / (p_i + eps))^(alpha beta), in (0, 1], so the step needs only its groups' current
priorities (`ReplayBuffer.priorities`). Each group carries its weight in `metadata[WEIGHT_KEY]` (it
travels to the other ranks with the group); `row_weights` gives them in `collate`'s row order, and the
step multiplies each row's advantages by its weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from offpolicy.learner.rl.advantages import grpo, reinforce, rloo

if TYPE_CHECKING:
    from offpolicy.buffer.types import TrajectoryGroup

WEIGHT_KEY = "offpolicy.is_weight"
"""The group metadata key holding its prioritized-replay importance weight (absent: 1)."""


def mean_abs_advantage(group: TrajectoryGroup, estimator: str = "grpo", norm_by_std: bool = True) -> float:
    """Mean |A| over the group's response tokens, A by `estimator` from its rewards (see the module)."""
    rewards = torch.tensor([float(t.reward) for t in group.trajectories], dtype=torch.float64)  # (n,)
    lengths = torch.tensor([max(len(t.response_ids), 1) for t in group.trajectories], dtype=torch.float64)
    index = torch.zeros(len(rewards), dtype=torch.long)
    ones = torch.ones(len(rewards), 1)  # (n, 1): one token per completion; lengths weight them below
    if estimator == "grpo":
        adv = grpo(rewards, index, ones, norm_by_std=norm_by_std)[:, 0]
    elif estimator == "rloo":
        adv = rloo(rewards, index, ones)[:, 0]
    elif estimator == "reinforce":
        adv = reinforce(rewards, index, ones)[:, 0]
    else:  # gae: the value baseline is out of reach here
        adv = rewards - rewards.mean()
    return float((adv.abs().double() * lengths).sum() / lengths.sum())


def priority(
    group: TrajectoryGroup,
    version: int,
    decay: float,
    estimator: str = "grpo",
    norm_by_std: bool = True,
    is_deviation: float = 0.0,
) -> float:
    """The priority the learner writes back for `group` at policy `version` (see the module)."""
    staleness = max(version - group.policy_version, 0)
    return mean_abs_advantage(group, estimator, norm_by_std) * (1.0 + is_deviation) * decay**staleness


def group_is_deviation(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor
) -> list[float]:
    """Per group (0..G-1): mean |log w| over its kept tokens, the `is_deviation` of `priority` (0 for a
    group with no kept token). `log_ratio` = log pi_old - log mu, `response_mask` (B, R), `group_index` (B,)
    as in `Batch`."""
    mask = response_mask.float()  # (B, R)
    per_row = torch.stack([(log_ratio.float().abs() * mask).sum(-1), mask.sum(-1)], -1)  # (B, 2)
    groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    sums = torch.zeros(groups, 2, dtype=per_row.dtype, device=per_row.device).index_add_(
        0, group_index, per_row
    )
    return (sums[:, 0] / sums[:, 1].clamp(min=1.0)).tolist()


def importance_weights(priorities: Sequence[float], eps: float, alpha: float, beta: float) -> list[float]:
    """((p_min + eps) / (p_i + eps))^(alpha beta) per group: (N P(i))^-beta over its batch maximum."""
    if not priorities:
        return []
    base = [max(p + eps, 1e-12) for p in priorities]  # a zero weight would give an infinite ratio
    low = min(base)
    return [(low / b) ** (alpha * beta) for b in base]


def weighted(groups: Sequence[TrajectoryGroup], weights: Sequence[float]) -> list[TrajectoryGroup]:
    """Copies of `groups` carrying their importance weights (`metadata[WEIGHT_KEY]`)."""
    return [
        dataclasses.replace(g, metadata={**g.metadata, WEIGHT_KEY: repr(float(w))})
        for g, w in zip(groups, weights, strict=True)
    ]


def row_weights(groups: Sequence[TrajectoryGroup]) -> torch.Tensor:
    """(B,) float in `collate`'s row order: each completion's group importance weight (1 without one)."""
    return torch.tensor(
        [float(g.metadata.get(WEIGHT_KEY, 1.0)) for g in groups for _ in g.trajectories], dtype=torch.float32
    )
