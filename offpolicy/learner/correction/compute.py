"""Rollout correction: IS weights, rejection mask and `rollout_corr/*` metrics for one batch (verl 0.9.1).

`compute_rollout_correction(train_log_prob, rollout_log_prob, response_mask, config)` is verl's
`compute_rollout_correction_and_rejection_mask` (its signature: `rollout_log_prob` is what the rest of the
project calls `behavior_logprobs`, the behaviour policy's log-probs) with the project's DECISIONS
(../shared/spec/rollout_correction.md): k1 bounds on rho = pi_train / pi_rollout, a `geometric` IS level,
the seed-era veto, no NaN on empty batches, and all metrics moved to the host in one transfer.

Deliberate simplifications: masks are 0/1 (a float mask's values other than 0 and 1 are not used as
token weights); weights, masks and the IS / RS metrics are computed in float32 whatever the input
dtype, and the weights come back in float32. The off-policy diagnostics and the sequence-level
`rollout_is_min` follow verl's type promotion when an input is float64, so that they stay finite where
exp(log rho) overflows float32. In decoupled mode call it once per batch with pi_old; in bypass mode
`learner/rl/losses.py` calls it per micro-batch with the current log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.learner.correction.config import RolloutCorrectionConfig
from offpolicy.learner.correction.metrics import (
    EPS,
    SAFETY_BOUND,
    CorrectionViews,
    ISStats,
    MetricSink,
    add_is_metrics,
    add_offpolicy_metrics,
    finite_or_zero,
)
from offpolicy.learner.correction.rejection import rejection
from offpolicy.learner.errors import CorrectionInputError

__all__ = [
    "SAFETY_BOUND",
    "CorrectionResult",
    "RolloutCorrectionConfig",
    "compute_rollout_correction",
]

METRIC_PREFIX = "rollout_corr/"
_EXP_LO = math.exp(-SAFETY_BOUND)
_EXP_HI = math.exp(SAFETY_BOUND)


@dataclass(frozen=True, slots=True)
class CorrectionResult:
    """Output of `compute_rollout_correction`."""

    weights: Tensor | None
    """(B, T) float32 IS weights, detached, 0 on padding (and outside the IcePop range); None if IS is off."""
    response_mask: Tensor
    """(B, T) the input mask with RS- and veto-rejected tokens set to 0, in the input mask's dtype."""
    metrics: dict[str, float] | dict[str, Tensor]
    """`rollout_corr/<key>` -> value: spec section 6 keys plus `rollout_is_veto_fraction` and
    `rollout_is_catastrophic_token_fraction`. Floats (one host transfer), or with `host_metrics=False`
    detached 0-d device tensors (no transfer; what the bypass loss returns per micro-batch)."""


def compute_rollout_correction(
    train_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    config: RolloutCorrectionConfig,
    *,
    host_metrics: bool = True,
) -> CorrectionResult:
    """IS weights, rejection mask and metrics for log pi_train (B, T) vs log pi_rollout (B, T)."""
    if train_log_prob.shape != rollout_log_prob.shape:
        raise CorrectionInputError(
            f"old_log_prob shape {train_log_prob.shape} does not match rollout_log_prob shape "
            f"{rollout_log_prob.shape}."
        )
    if train_log_prob.shape != response_mask.shape or train_log_prob.dim() != 2:
        raise CorrectionInputError(
            f"log_prob shape {train_log_prob.shape} does not match response_mask shape {response_mask.shape} "
            "(both must be (B, T))."
        )
    if response_mask.numel() == 0:  # B == 0 or T == 0: same keys, computed on one padding token.
        pad = torch.zeros((1, 1), dtype=train_log_prob.dtype, device=train_log_prob.device)
        pad_mask = torch.zeros((1, 1), dtype=response_mask.dtype, device=response_mask.device)
        one = compute_rollout_correction(pad, pad, pad_mask, config, host_metrics=host_metrics)
        weights = (
            None
            if one.weights is None
            else train_log_prob.new_zeros(train_log_prob.shape, dtype=torch.float32)
        )
        return CorrectionResult(weights, response_mask.clone(), one.metrics)
    with torch.no_grad():
        weights, new_mask, sink = _correct(train_log_prob, rollout_log_prob, response_mask, config)
    metrics = sink.to_host(METRIC_PREFIX) if host_metrics else sink.to_tensors(METRIC_PREFIX)
    return CorrectionResult(weights, new_mask, metrics)


def _correct(
    train_log_prob: Tensor, behavior_logprobs: Tensor, mask: Tensor, config: RolloutCorrectionConfig
) -> CorrectionResult:
    train_log_prob, behavior_logprobs = train_log_prob.detach(), behavior_logprobs.detach()
    mb = mask if mask.dtype == torch.bool else mask != 0  # (B, T)
    m = mask.float()  # (B, T); no copy for a float32 mask
    log_ratio = torch.where(mb, train_log_prob.float() - behavior_logprobs.float(), 0.0)  # (B, T), 0: padding
    # Where verl exponentiates an unclamped log-ratio (k3_kl, rollout_is_min at sequence level) it does so
    # in the dtype its inputs promote to (`_v`: verl's): a float64 input keeps exp(log_ratio) finite past
    # float32's ~88.7.
    log_ratio_dtype = _metric_dtype(train_log_prob, behavior_logprobs)
    all_dtype = _metric_dtype(train_log_prob, behavior_logprobs, mask)
    log_ratio_v = (
        log_ratio
        if log_ratio_dtype == torch.float32
        else torch.where(mb, train_log_prob.to(log_ratio_dtype) - behavior_logprobs, 0.0)
    )  # (B, T)
    s_row = log_ratio.sum(dim=-1)  # (B,)
    s_row_v = s_row if all_dtype == torch.float32 else log_ratio_v.to(all_dtype).sum(dim=-1)  # (B,)
    cnt = m.sum(dim=-1)  # (B,)
    row_valid = cnt > 0
    b = CorrectionViews(mb, m, log_ratio, cnt, cnt.sum(), row_valid, row_valid.sum().float(), s_row, s_row_v)
    lc = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    e_unclamped = torch.exp(log_ratio)  # (B, T), 1 on padding
    e_v = e_unclamped if log_ratio_v is log_ratio else torch.exp(log_ratio_v)
    k3_sum = (e_v - log_ratio_v).sub_(1.0).sum()  # padding adds exp(0) - 0 - 1 = 0
    rho = e_unclamped.clamp_(_EXP_LO, _EXP_HI)  # (B, T) exp(clampS(log_ratio)), in place
    rho_m = rho * m  # (B, T) token-level raw IS weights, 0 on padding
    sink = MetricSink()

    weights = None
    if config.is_enabled:
        weights = _is_weights(b, rho_m, config, sink)

    keep_tok, keep_row = rejection(b, lc, rho, config, sink)
    keep_row = _veto(b, config, sink, keep_row)
    if keep_tok is None and keep_row is None:
        new_mask = mask.clone()
    else:
        keep = keep_row.unsqueeze(-1) if keep_tok is None else keep_tok
        if keep_tok is not None and keep_row is not None:
            keep = keep_tok & keep_row.unsqueeze(-1)
        new_mask = mask.masked_fill(~keep, 0)

    rho2_sum = torch.dot(rho_m.view(-1), rho_m.view(-1))
    train_row_sum = torch.where(mb, train_log_prob.to(_metric_dtype(train_log_prob, mask)), 0.0).sum(dim=-1)
    if all_dtype == torch.float32:  # one (B, T) pass less
        roll_row_sum = train_row_sum - s_row
    else:
        dtype = _metric_dtype(behavior_logprobs, mask)
        roll_row_sum = torch.where(mb, behavior_logprobs.to(dtype), 0.0).sum(dim=-1)  # (B,)
    add_offpolicy_metrics(sink, b.cnt, s_row_v, train_row_sum, roll_row_sum, k3_sum, rho2_sum)
    return weights, new_mask, sink


def _metric_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype verl computes in by type promotion, at least float32 (a bool mask adds none)."""
    dtype = torch.float32
    for x in tensors:
        if x.is_floating_point():
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


# --- importance sampling (spec 3, DECISION 5)


def _is_weights(
    b: CorrectionViews, rho_m: Tensor, config: RolloutCorrectionConfig, sink: MetricSink
) -> Tensor:
    upper, icepop_lower = config.is_bounds()
    lower = 1.0 / upper if icepop_lower is None else icepop_lower
    if config.rollout_is == "token":
        w, stats = _token_is(b, rho_m, upper, icepop_lower)
    else:
        w, stats = _sequence_is(b, config.rollout_is == "geometric", upper, icepop_lower)
    add_is_metrics(sink, stats, b, upper, lower)
    if config.rollout_is_batch_normalize:
        w = _batch_normalize(b, w, stats, config.rollout_is == "token", sink)
    return w


def _token_is(
    b: CorrectionViews, raw: Tensor, upper: float, icepop_lower: float | None
) -> tuple[Tensor, ISStats]:
    n_high = (raw > upper).sum()  # padding is 0, never above upper
    below = raw < (1.0 / upper if icepop_lower is None else icepop_lower)
    n_low = below.sum() - (b.mb.numel() - b.mb.sum())  # every padding token is 0 < lower
    if icepop_lower is None:
        w = raw.clamp(max=upper)  # (B, T)
        n_oob = None
    else:
        w = raw.masked_fill(below | (raw > upper), 0.0)  # (B, T)
        n_oob = n_low + n_high
    row_sum_w = w.sum(dim=-1)  # (B,)
    w_flat = w.view(-1)
    stats = ISStats(
        sum_w=row_sum_w.sum(),
        sum_w2=torch.dot(w_flat, w_flat),
        row_mean_w=row_sum_w / (b.cnt + EPS),
        row_mean_raw=raw.sum(dim=-1) / (b.cnt + EPS),
        w_max=w.amax(),  # w >= 0 and 0 on padding: the masked max
        w_min=finite_or_zero(torch.where(b.mb, w, float("inf")).amin()),
        n_high=n_high.float(),
        n_low=n_low.float(),
        frac_denominator=b.n + EPS,
        n_oob=None if n_oob is None else n_oob.float(),
    )
    return w, stats


def _sequence_is(
    b: CorrectionViews, geometric: bool, upper: float, icepop_lower: float | None
) -> tuple[Tensor, ISStats]:
    # One weight per row; (B, T) is materialized once, at the end.
    level_log = b.s_row / (b.cnt + EPS) if geometric else b.s_row  # (B,) log of the sequence ratio
    raw_row = torch.exp(level_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (B,)
    lower = 1.0 / upper if icepop_lower is None else icepop_lower
    if icepop_lower is None:
        w_row = raw_row.clamp(max=upper)
        n_oob = None
    else:
        out = (raw_row < icepop_lower) | (raw_row > upper)
        w_row = raw_row.masked_fill(out, 0.0)
        n_oob = (out.float() * b.cnt).sum()
    share = b.cnt / (b.cnt + EPS)  # (B,) 1 for valid rows, 0 for empty rows
    n_rows = float(b.cnt.numel())
    stats = ISStats(
        sum_w=(w_row * b.cnt).sum(),
        sum_w2=(w_row.square() * b.cnt).sum(),
        row_mean_w=w_row * share,
        row_mean_raw=raw_row * share,
        w_max=torch.exp(level_log.amax().clamp(max=SAFETY_BOUND)),
        w_min=torch.exp((b.s_row_v / (b.cnt + EPS) if geometric else b.s_row_v).amin()),  # unclamped
        n_high=(level_log > math.log(upper)).sum().float(),
        n_low=(level_log < math.log(lower)).sum().float(),
        frac_denominator=torch.tensor(n_rows, device=w_row.device),
        n_oob=n_oob,
    )
    return w_row.unsqueeze(-1) * b.m, stats


def _batch_normalize(
    b: CorrectionViews, w: Tensor, stats: ISStats, token_level: bool, sink: MetricSink
) -> Tensor:
    """Divide by the batch mean weight (tokens or valid rows); all-reduced under torch.distributed."""
    if token_level:
        total, count = stats.sum_w, b.n
    else:
        total, count = (stats.row_mean_w * b.row_valid).sum(), b.n_rows
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pair = torch.stack([total, count.to(total.dtype)])
        torch.distributed.all_reduce(pair)
        mu = pair[0] / pair[1]
    elif token_level:
        mu = total / (count + EPS)
    else:
        mu = total / count.clamp(min=EPS)
    ok = mu > EPS
    factor = torch.where(ok, mu, torch.ones_like(mu))
    sink.add("rollout_is_batch_norm_factor", factor)
    return w.div_(factor)


# --- veto (DECISION 4); rejection sampling (spec 4, DECISION 3) is learner/correction/rejection.py


def _veto(
    b: CorrectionViews, config: RolloutCorrectionConfig, sink: MetricSink, keep_row: Tensor | None
) -> Tensor | None:
    """Reject every row holding a valid token with rho < veto (unclamped); AND with the RS row keep."""
    veto = config.rollout_token_veto_threshold
    if veto is None:
        sink.add("rollout_is_veto_fraction", 0.0)
        sink.add("rollout_is_catastrophic_token_fraction", 0.0)
        return keep_row
    catastrophic = b.log_ratio < math.log(veto)  # (B, T)
    if veto > 1.0:  # padding has log_ratio = 0 < log(veto)
        catastrophic &= b.mb
    per_row = catastrophic.sum(dim=-1)  # (B,)
    vetoed = per_row > 0
    sink.add("rollout_is_veto_fraction", vetoed.float().mean())
    sink.add("rollout_is_catastrophic_token_fraction", per_row.sum() / (b.n + EPS))
    return ~vetoed if keep_row is None else keep_row & ~vetoed
