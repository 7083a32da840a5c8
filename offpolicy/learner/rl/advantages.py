"""Advantage estimators: GRPO, RLOO, REINFORCE (batch baseline) from per-completion rewards, and GAE.

Pure functions. The outcome estimators take one scalar reward per completion (B,) and a group index
(B,) (completions of the same prompt share an index) and return per-token advantages (B, T), the
completion's advantage broadcast over its response mask and 0 on padding. They follow verl 0.9.1's
`compute_grpo_outcome_advantage` / `compute_rloo_outcome_advantage`; `gae` is its
`compute_gae_advantage_return` (advantages whitened over the mask, returns = raw advantages + values);
`token_rewards` places each completion's reward on its last sampled token for GAE. `distill` mixes the
per-token reward of on-policy distillation into the advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.learner.errors import CorrectionInputError

ESTIMATORS = ("grpo", "rloo", "reinforce")


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per completion: (group size, group mean, group unbiased std), all (B,)."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    size = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    total = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    mean = total / size
    sq = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inverse, (rewards - mean[inverse]).square()
    )
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    return size[inverse], mean[inverse], std[inverse]


def _broadcast(scores: Tensor, response_mask: Tensor) -> Tensor:
    return scores.unsqueeze(-1) * response_mask.to(scores.dtype)  # (B, T)


def grpo(
    rewards: Tensor,
    group_index: Tensor,
    response_mask: Tensor,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> Tensor:
    """(r - group mean) / (group std + epsilon), or without the std division (verl's GRPO).

    The std is unbiased; a group of one has mean 0 and std 1, as in verl, so it keeps r / (1 + epsilon).
    """
    size, mean, std = _group_stats(rewards.float(), group_index)
    single = size == 1
    mean = torch.where(single, 0.0, mean)  # verl: mean 0, std 1 for a group of one
    std = torch.where(single, 1.0, std)
    scores = rewards.float() - mean
    if norm_by_std:
        scores = scores / (std + epsilon)
    return _broadcast(scores, response_mask)


def rloo(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """r minus the mean of the other completions of its group; a group of one keeps its reward."""
    r = rewards.float()
    size, mean, _ = _group_stats(r, group_index)
    n = size.clamp(min=2)
    scores = torch.where(size > 1, r * n / (n - 1) - mean * n / (n - 1), r)
    return _broadcast(scores, response_mask)


def reinforce(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """r minus the batch-mean reward (`group_index` is unused, kept for a uniform signature)."""
    r = rewards.float()
    return _broadcast(r - r.mean(), response_mask)


def compute_advantages(estimator: str, rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """Dispatch to `grpo`, `rloo` or `reinforce` by name (GAE needs a critic: call `gae`)."""
    if estimator == "grpo":
        return grpo(rewards, group_index, response_mask)
    if estimator == "rloo":
        return rloo(rewards, group_index, response_mask)
    if estimator == "reinforce":
        return reinforce(rewards, group_index, response_mask)
    raise CorrectionInputError(
        f"Unknown advantage estimator {estimator!r}; expected one of {list(ESTIMATORS)}."
    )


def gae(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """(advantages whitened over the mask, returns), each (B, T): verl's compute_gae_advantage_return.

    Padding positions carry the next valid value and advantage through (verl's recursion). Whitening
    uses the masked mean and the unbiased masked variance; it needs at least two valid tokens.
    """
    m = response_mask.to(values.dtype)
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        last = torch.zeros_like(values[:, 0])
        reversed_adv = []
        for t in reversed(range(token_rewards.shape[-1])):
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * last
            next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
            last = candidate * m[:, t] + (1 - m[:, t]) * last
            reversed_adv.append(last)
        advantages = torch.stack(reversed_adv[::-1], dim=1)  # (B, T)
        returns = advantages + values
        count = m.sum()
        if count < 2:
            raise CorrectionInputError("gae needs at least two valid tokens to whiten the advantages.")
        mean = (advantages * m).sum() / (count + 1e-8)
        var = ((advantages - mean).square() * m).sum() / (count + 1e-8) * (count / (count - 1))
        return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


def token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) rewards placed on each row's last valid response token: (B, R)."""
    last = (response_mask.cumsum(-1) == response_mask.sum(-1, keepdim=True)) & (response_mask > 0)  # (B, R)
    first_last = last & (last.cumsum(-1) == 1)
    return first_last.float() * rewards[:, None]


def distill(
    advantages: Tensor,
    old_log_probs: Tensor,
    teacher_log_probs: Tensor,
    response_mask: Tensor,
    reward_weight: float,
    task_reward_weight: float,
) -> tuple[Tensor, Tensor]:
    """On-policy distillation's advantages and the batch's reverse KL to the teacher.

    Per token t of a row, with m_t the response mask (0 on padding, environment tokens and tokens the
    rollout correction rejected):

        A'_t = task_reward_weight * A_t + reward_weight * (log pi_teacher(y_t) - log pi_old(y_t)) * m_t

    `advantages` (B, T) are the task's (any estimator's); pi_old is the policy that sampled (bypass mode:
    the behaviour log-probs), all three log-probs (B, T) at the row's temperature and detached, so the
    policy gradient of the unchanged PPO loss follows -(log pi - log pi_teacher): it minimises the reverse
    KL(pi || pi_teacher) on the student's own samples (as TRL's, NeMo-RL's and Thinking Machines'
    on-policy distillation). Returns (A', the token mean of log pi_old - log pi_teacher over the mask: the
    reverse KL's per-token estimate, a 0-dim tensor)."""
    m = response_mask.to(torch.float32)
    gap = (old_log_probs.float() - teacher_log_probs.float()).detach() * m  # (B, T) log pi_old - log pi_T
    mixed = task_reward_weight * advantages.float() * m - reward_weight * gap
    return mixed, gap.sum() / m.sum().clamp(min=1.0)
