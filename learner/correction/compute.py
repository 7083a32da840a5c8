"""Rollout correction: IS weights, rejection mask and `rollout_corr/*` metrics for one batch (verl 0.9.1).

`compute_rollout_correction(train_log_prob, rollout_log_prob, response_mask, config)` is verl's
`compute_rollout_correction_and_rejection_mask` with the project's DECISIONS
(../shared/spec/rollout_correction.md): k1 bounds on rho = pi_train / pi_rollout, a `geometric` IS level,
the seed-era veto, no NaN on empty batches, and all metrics moved to the host in one transfer.

Deliberate simplifications: masks are 0/1 (a float mask's values other than 0 and 1 are not used as
token weights); weights, masks and the IS / RS metrics are computed in float32 whatever the input
dtype, and the weights come back in float32. The off-policy diagnostics and the sequence-level
`rollout_is_min` follow verl's type promotion when an input is float64, so that they stay finite where
exp(log rho) overflows float32. In decoupled mode call it once per batch with pi_old; in bypass mode
`learner/losses.py` calls it per micro-batch with the current log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.correction.config import (
    TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
    RolloutCorrectionConfig,
    RSOption,
)
from learner.correction.metrics import (
    EPS,
    SAFETY_BOUND,
    Batch,
    ISStats,
    MetricSink,
    RSStats,
    add_is_metrics,
    add_offpolicy_metrics,
    add_rs_metrics,
    finite_or_zero,
    masked_extrema,
)
from learner.errors import CorrectionInputError

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
    lp_train: Tensor, lp_roll: Tensor, mask: Tensor, config: RolloutCorrectionConfig
) -> CorrectionResult:
    lp_train, lp_roll = lp_train.detach(), lp_roll.detach()
    mb = mask if mask.dtype == torch.bool else mask != 0  # (B, T)
    m = mask.float()  # (B, T); no copy for a float32 mask
    lr = torch.where(mb, lp_train.float() - lp_roll.float(), 0.0)  # (B, T) 0 on padding
    # Where verl exponentiates an unclamped log-ratio (k3_kl, rollout_is_min at sequence level) it does so
    # in the dtype its inputs promote to: a float64 input keeps exp(lr) finite past float32's ~88.7.
    lr_dtype, all_dtype = _metric_dtype(lp_train, lp_roll), _metric_dtype(lp_train, lp_roll, mask)
    lr_v = lr if lr_dtype == torch.float32 else torch.where(mb, lp_train.to(lr_dtype) - lp_roll, 0.0)
    s_row = lr.sum(dim=-1)  # (B,)
    s_row_v = s_row if all_dtype == torch.float32 else lr_v.to(all_dtype).sum(dim=-1)  # (B,)
    cnt = m.sum(dim=-1)  # (B,)
    row_valid = cnt > 0
    b = Batch(mb, m, lr, cnt, cnt.sum(), row_valid, row_valid.sum().float(), s_row, s_row_v)
    lc = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    e_unclamped = torch.exp(lr)  # (B, T), 1 on padding
    e_v = e_unclamped if lr_v is lr else torch.exp(lr_v)
    k3_sum = (e_v - lr_v).sub_(1.0).sum()  # padding adds exp(0) - 0 - 1 = 0
    rho = e_unclamped.clamp_(_EXP_LO, _EXP_HI)  # (B, T) exp(clampS(lr)), in place
    rho_m = rho * m  # (B, T) token-level raw IS weights, 0 on padding
    sink = MetricSink()

    weights = None
    if config.is_enabled:
        weights = _is_weights(b, rho_m, config, sink)

    keep_tok, keep_row = _rejection(b, lc, rho, config, sink)
    keep_row = _veto(b, config, sink, keep_row)
    if keep_tok is None and keep_row is None:
        new_mask = mask.clone()
    else:
        keep = keep_row.unsqueeze(-1) if keep_tok is None else keep_tok
        if keep_tok is not None and keep_row is not None:
            keep = keep_tok & keep_row.unsqueeze(-1)
        new_mask = mask.masked_fill(~keep, 0)

    rho2_sum = torch.dot(rho_m.view(-1), rho_m.view(-1))
    train_row_sum = torch.where(mb, lp_train.to(_metric_dtype(lp_train, mask)), 0.0).sum(dim=-1)  # (B,)
    if all_dtype == torch.float32:  # one (B, T) pass less
        roll_row_sum = train_row_sum - s_row
    else:
        roll_row_sum = torch.where(mb, lp_roll.to(_metric_dtype(lp_roll, mask)), 0.0).sum(dim=-1)  # (B,)
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


def _is_weights(b: Batch, rho_m: Tensor, config: RolloutCorrectionConfig, sink: MetricSink) -> Tensor:
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


def _token_is(b: Batch, raw: Tensor, upper: float, icepop_lower: float | None) -> tuple[Tensor, ISStats]:
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
    b: Batch, geometric: bool, upper: float, icepop_lower: float | None
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


def _batch_normalize(b: Batch, w: Tensor, stats: ISStats, token_level: bool, sink: MetricSink) -> Tensor:
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


# --- rejection sampling (spec 4, DECISION 3) and veto (DECISION 4)


def _rejection(
    b: Batch, lc: Tensor, rho: Tensor, config: RolloutCorrectionConfig, sink: MetricSink
) -> tuple[Tensor | None, Tensor | None]:
    """AND of every RS option: (token keep (B, T) bool or None, row keep (B,) bool or None)."""
    options = config.rs_options()
    if not options:
        return None, None
    keep_tok: Tensor | None = None
    keep_row: Tensor | None = None
    names = {o.name for o in options}
    shared = _Shared(
        lc,
        rho,
        extrema=masked_extrema(lc, b.mb) if names & {"token_k1", "seq_max_k2", "seq_max_k3"} else None,
        lc_row_sum=lc.sum(dim=-1) if any(n.endswith("k1") for n in names) else None,
    )
    for opt in options:
        if opt.name in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS:
            keep, stats = _token_option(b, shared, opt)
            keep_tok = keep if keep_tok is None else keep_tok & keep
        else:
            keep, stats = _sequence_option(b, shared, opt)
            keep_row = keep if keep_row is None else keep_row & keep
        add_rs_metrics(sink, stats, b)
    # Global RS keys: fraction of valid tokens rejected by any option, fraction of all rows hit.
    if keep_tok is not None:
        rejected = b.mb & ~keep_tok if keep_row is None else b.mb & ~(keep_tok & keep_row.unsqueeze(-1))
        row_rejected = rejected.sum(dim=-1)  # (B,)
    else:
        row_rejected = torch.where(keep_row, 0.0, b.cnt)
    sink.add("rollout_rs_masked_fraction", row_rejected.sum() / (b.n + EPS))
    sink.add("rollout_rs_seq_masked_fraction", (row_rejected > 0).float().mean())
    return keep_tok, keep_row


@dataclass(slots=True)
class _Shared:
    """Tensors shared by the RS options of one call."""

    lc: Tensor  # (B, T) clampS(lr), 0 on padding
    rho: Tensor  # (B, T) exp(lc), 1 on padding
    extrema: tuple[Tensor, Tensor] | None  # (B,) masked row max / min of lc
    lc_row_sum: Tensor | None  # (B,) row sums of lc


def _k1_log_bounds(opt: RSOption) -> tuple[float, float]:
    """verl's (log lower, log upper) on k1 = -log rho, from our bounds on rho: verl bounds (1/u, 1/l)."""
    assert opt.lower is not None
    return math.log(1.0 / opt.upper), math.log(1.0 / opt.lower)


def _token_stat(lc: Tensor, rho: Tensor, k: str) -> Tensor:
    """Per-token k1 / k2 / k3 statistic (B, T); 0 on padding because lc = 0 and rho = 1 there."""
    if k == "k1":
        return -lc
    if k == "k2":
        return 0.5 * lc.square()
    return rho - 1.0 - lc


def _token_option(b: Batch, sh: _Shared, opt: RSOption) -> tuple[Tensor, RSStats]:
    k = opt.name[-2:]
    s = _token_stat(sh.lc, sh.rho, k)  # (B, T)
    if k == "k1":
        assert sh.extrema is not None and sh.lc_row_sum is not None
        thr_lo, thr_hi = _k1_log_bounds(opt)
        row_s = -sh.lc_row_sum  # (B,)
        tok_max, tok_min = -sh.extrema[1].amin(), -sh.extrema[0].amax()
    else:
        thr_lo, thr_hi = 0.0, opt.upper
        row_s = s.sum(dim=-1)
        row_max, row_min = masked_extrema(s, b.mb)
        tok_max, tok_min = row_max.amax(), row_min.amin()
    high = (s > thr_hi) & b.mb  # (B, T)
    low = (s < thr_lo) & b.mb if k == "k1" else None
    rejected = high if low is None else high | low  # (B, T), valid tokens only
    clamped = s.clamp(thr_lo, thr_hi).mul_(b.m)  # (B, T)
    flat = clamped.view(-1)
    row_rej = rejected.sum(dim=-1)  # (B,)
    stats = RSStats(
        name=opt.name,
        is_k1=k == "k1",
        level="token",
        thr_upper=thr_hi,
        thr_lower=thr_lo,
        sum_s=row_s.sum(),
        std_s1=flat.sum(),
        std_s2=torch.dot(flat, flat),
        q=row_s / (b.cnt + EPS),
        tok_max=tok_max,
        tok_min=tok_min,
        n_high=high.sum().float(),
        n_low=None if low is None else low.sum().float(),
        n_rejected=row_rej.sum().float(),
        row_rejects=row_rej > 0,
    )
    return ~rejected, stats


def _sequence_option(b: Batch, sh: _Shared, opt: RSOption) -> tuple[Tensor, RSStats]:
    agg, k = opt.name.split("_")[1], opt.name[-2:]
    if agg == "max":  # max of k2 / k3 over valid tokens sits at the row's largest or smallest log-ratio
        assert sh.extrema is not None
        hi, lo = (finite_or_zero(x) for x in sh.extrema)  # empty rows give 0, as verl's _sequence_max
        stat = _row_stat_from_extrema(hi, lo, k)
    else:
        row_sum = -sh.lc_row_sum if sh.lc_row_sum is not None and k == "k1" else None
        if row_sum is None:
            row_sum = _token_stat(sh.lc, sh.rho, k).sum(dim=-1)
        stat = row_sum if agg == "sum" else row_sum / (b.cnt + EPS)  # (B,)
    if k == "k1":
        thr_lo, thr_hi = _k1_log_bounds(opt)
        keep = (stat >= thr_lo) & (stat <= thr_hi)
    else:
        thr_lo, thr_hi = 0.0, opt.upper
        keep = stat <= thr_hi
    clamped = stat.clamp(thr_lo, thr_hi)
    row_rejects = ~keep & b.row_valid
    stats = RSStats(
        name=opt.name,
        is_k1=k == "k1",
        level="sequence",
        thr_upper=thr_hi,
        thr_lower=thr_lo,
        sum_s=(stat * b.cnt).sum(),
        std_s1=(clamped * b.cnt).sum(),
        std_s2=(clamped.square() * b.cnt).sum(),
        q=stat,
        tok_max=None,
        tok_min=None,
        n_high=None,
        n_low=None,
        n_rejected=torch.where(row_rejects, b.cnt, 0.0).sum(),
        row_rejects=row_rejects,
    )
    return keep, stats


def _row_stat_from_extrema(hi: Tensor, lo: Tensor, k: str) -> Tensor:
    if k == "k2":
        return 0.5 * torch.maximum(hi.square(), lo.square())
    return torch.maximum(torch.exp(hi) - 1.0 - hi, torch.exp(lo) - 1.0 - lo)


def _veto(
    b: Batch, config: RolloutCorrectionConfig, sink: MetricSink, keep_row: Tensor | None
) -> Tensor | None:
    """Reject every row holding a valid token with rho < veto (unclamped); AND with the RS row keep."""
    veto = config.rollout_token_veto_threshold
    if veto is None:
        sink.add("rollout_is_veto_fraction", 0.0)
        sink.add("rollout_is_catastrophic_token_fraction", 0.0)
        return keep_row
    catastrophic = b.lr < math.log(veto)  # (B, T)
    if veto > 1.0:  # padding has lr = 0 < log(veto)
        catastrophic &= b.mb
    per_row = catastrophic.sum(dim=-1)  # (B,)
    vetoed = per_row > 0
    sink.add("rollout_is_veto_fraction", vetoed.float().mean())
    sink.add("rollout_is_catastrophic_token_fraction", per_row.sum() / (b.n + EPS))
    return ~vetoed if keep_row is None else keep_row & ~vetoed
