"""Policy losses: verl 0.9.1's `agg_loss` and PPO-clip / REINFORCE with rollout correction (spec 5.2-5.4).

- `aggregate_loss(loss_mat, mask, mode, ...)`: the five aggregation modes, dp_size = 1. The learner passes
  global denominators (`batch_num_tokens`, `global_batch_size`) when it accumulates gradients over
  micro-batches. Unlike verl, an empty mask gives loss 0 with zero gradient, never NaN (DECISION 7).
- `compute_policy_loss(...)`: decoupled PPO-clip against pi_old with the IS weights applied per token, or
  bypass mode (`correction.bypass_mode`), where the correction is recomputed under no_grad from the
  current log-probs against pi_rollout and the loss is PPO-clip (ratio to pi_rollout, IS weights only as
  metrics) or REINFORCE (-A * w * log pi).
- `kl_penalty(log_prob, ref_log_prob, kind)`: verl 0.9.1's per-token KL estimators against the reference
  (k1 `kl`, `abs`, k2 `mse`, k3 `low_var_kl`; a trailing `+` takes k2's gradient, straight-through).
- `value_loss(...)`: the GAE critic's PPO clipped value loss.

Metrics come back as a dict of detached 0-d tensors, so the train loop can sum them over micro-batches
and move them to the host once per step (`torch.stack(list(d.values())).tolist()`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction
from offpolicy.learner.errors import CorrectionInputError

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


def _nonzero(x: Tensor | float) -> Tensor | float:
    """The denominator itself, or 1 where it is 0 (the numerator is then 0 too)."""
    if isinstance(x, Tensor):
        return torch.where(x > 0, x, torch.ones_like(x))
    return x if x > 0 else 1.0


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    batch_num_tokens: Tensor | float | None = None,
    global_batch_size: Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Scalar loss from per-token losses (B, T) over `mask` (B, T), as verl 0.9.1's `agg_loss`.

    token-mean: sum(L*m) / N, N = batch_num_tokens or sum(m). token-sum: sum(L*m).
    seq-mean-token-sum: sum_b s_b / G over rows with a valid token, s_b = sum_t L*m, G = global_batch_size
    or the number of such rows; -norm divides that by loss_scale_factor (default T).
    seq-mean-token-mean: the same mean over rows of s_b / (count_b + 1e-8).
    """
    if mode not in LOSS_AGG_MODES:
        raise CorrectionInputError(f"Invalid loss_agg_mode: {mode}. Must be one of {list(LOSS_AGG_MODES)}.")
    m = mask.to(loss_mat.dtype)
    masked = torch.where(mask.bool(), loss_mat, 0.0) * m  # (B, T); padding NaN/inf cannot leak
    if mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        return masked.sum() / _nonzero(n)
    if mode == "token-sum":
        return masked.sum()
    count = m.sum(dim=-1)  # (B,)
    row = masked.sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-mean":
        row = row / (count + 1e-8)
    rows = (count > 0).to(loss_mat.dtype)  # (B,)
    g = rows.sum() if global_batch_size is None else global_batch_size
    loss = (row * rows).sum() / _nonzero(g)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """Output of `compute_policy_loss`."""

    loss: Tensor
    """() the aggregated loss, with gradient through `log_prob`."""
    metrics: dict[str, Tensor]
    """`actor/*` (and in bypass mode `rollout_corr/*`) keys -> detached 0-d tensors."""
    response_mask: Tensor
    """(B, T) the mask the loss used (the RS-modified one in bypass mode)."""


@dataclass(frozen=True, slots=True)
class ClipConfig:
    """PPO clipping: ratio clipped to [1 - low, 1 + high]; dual clip bounds negative-advantage losses."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0


def compute_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip: ClipConfig = ClipConfig(),
    rollout_is_weights: Tensor | None = None,
    behavior_logprobs: Tensor | None = None,
    correction: RolloutCorrectionConfig | None = None,
    batch_num_tokens: Tensor | float | None = None,
    global_batch_size: Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> PolicyLoss:
    """Policy-gradient loss for current `log_prob` (B, T, with grad) and `advantages` (B, T).

    Decoupled (correction None or not bypass): PPO-clip against `old_log_prob` (pi_old), loss per token
    times `rollout_is_weights` when given. Bypass (`correction.bypass_mode`): needs `behavior_logprobs`;
    `old_log_prob` is ignored (pi_old := pi_rollout). The last three go to `aggregate_loss`: a micro-batch
    passes its mini-batch's valid tokens, rows and width T, so micro-batch losses add up to its loss.
    """
    agg = {
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    if correction is None or not correction.bypass_mode:
        if old_log_prob is None:
            raise CorrectionInputError("decoupled mode needs old_log_prob (pi_old).")
        loss, metrics = _ppo_clip(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, clip)
        return PolicyLoss(aggregate_loss(loss, response_mask, loss_agg_mode, **agg), metrics, response_mask)
    if behavior_logprobs is None:
        raise CorrectionInputError(
            "bypass_mode=True requires behavior_logprobs (the behaviour policy's log-probs, pi_rollout)."
        )
    corr = compute_rollout_correction(  # verl-shaped: its `rollout_log_prob` is our behavior_logprobs
        log_prob.detach(), behavior_logprobs, response_mask, correction, host_metrics=False
    )
    mask = corr.response_mask
    if correction.loss_type == "reinforce":
        w = corr.weights
        loss_mat = -advantages * log_prob if w is None else -advantages * log_prob * w
        m = mask.bool()
        kl = torch.where(m, behavior_logprobs - log_prob.detach(), 0.0).sum() / (m.sum() + 1e-8)
        metrics = {"actor/ppo_kl": kl.float()}
    else:
        loss_mat, metrics = _ppo_clip(log_prob, behavior_logprobs, advantages, mask, None, clip)
    loss = aggregate_loss(loss_mat, mask, loss_agg_mode, **agg)
    return PolicyLoss(loss, {**metrics, **corr.metrics}, mask)  # type: ignore[dict-item]


def _ppo_clip(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    clip: ClipConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's compute_policy_loss_vanilla before aggregation: (per-token loss (B, T), metrics)."""
    if not clip.clip_ratio_c > 1.0:
        raise CorrectionInputError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip.clip_ratio_c}.")
    low = clip.clip_ratio if clip.clip_ratio_low is None else clip.clip_ratio_low
    high = clip.clip_ratio if clip.clip_ratio_high is None else clip.clip_ratio_high
    neg_kl = (log_prob - old_log_prob).clamp(-20.0, 20.0)  # (B, T)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    clipped1 = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip.clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(loss3, clipped1), clipped1)
    if weights is not None:
        loss_mat = loss_mat * weights
    with torch.no_grad():
        m = mask.bool()
        denom = m.sum() + 1e-8
        metrics = {
            "actor/pg_clipfrac": ((loss2 > loss1) & m).sum() / denom,
            "actor/ppo_kl": torch.where(m, -neg_kl, 0.0).sum() / denom,
            "actor/pg_clipfrac_lower": ((clipped1 > loss3) & negative & m).sum() / denom,
        }
    return loss_mat, {k: v.float() for k, v in metrics.items()}


# --- the KL loss against the reference policy


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference, (B, T), as verl 0.9.1's `kl_penalty`
    (J. Schulman, "Approximating KL divergence"): `kl`/`k1` = log pi - log ref, `abs` = |k1|, `mse`/`k2` =
    k1^2 / 2, `low_var_kl`/`k3` = exp(ref - pi) - (ref - pi) - 1 with the log-ratio clamped to [-20, 20]
    and the result to [-10, 10]. A trailing `+` keeps the value and takes the gradient of k2 (unbiased for
    the KL's gradient; `mse+` and `k2+` are k2)."""
    base = kind.removesuffix("+")
    diff = log_prob - ref_log_prob  # (B, T)
    if base in ("kl", "k1"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * diff.square()
    elif base in ("low_var_kl", "k3"):
        kl = (-diff).clamp(-20.0, 20.0)
        value = (torch.exp(kl) - kl - 1).clamp(-10.0, 10.0)
    else:
        raise CorrectionInputError(f"Invalid kl_loss_type: {kind}.")
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


# --- the critic (GAE)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    denominator: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss summed over `mask` and divided by `denominator` (the mini-batch's sampled
    tokens, so micro-batch losses add up to the mini-batch's token-mean whatever the split); returns
    (loss, metrics: 0-d tensors, this call's token-means)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    n = mask.sum().clamp(min=1.0)
    total = 0.5 * (torch.maximum(l1, l2) * mask).sum()
    loss = total / denominator
    metrics = {
        "critic/vf_loss": total.detach() / n,
        "critic/vf_clipfrac": ((l2 > l1).float() * mask).sum() / n,
        "critic/values_mean": (values.detach() * mask).sum() / n,
    }
    return loss, metrics
