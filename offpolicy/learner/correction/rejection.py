"""Rejection sampling of rollout correction (spec 4, DECISION 3): the AND of every `rollout_rs` option.

Token-level options (`token_k1`, `token_k2`, `token_k3`) give a (B, T) keep mask, sequence-level ones
(`seq_sum_*`, `seq_mean_*`, `seq_max_*`) a (B,) row keep; each adds its `rollout_rs_*` metrics. Statistics
are on clampS(log rho) (k1 = -log rho, k2 = 0.5 log^2 rho, k3 = rho - 1 - log rho), thresholds as verl
0.9.1 parses them. Called by `compute.compute_rollout_correction`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.learner.correction.config import (
    TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
    RolloutCorrectionConfig,
    RSOption,
)
from offpolicy.learner.correction.metrics import (
    EPS,
    CorrectionViews,
    MetricSink,
    RSStats,
    add_rs_metrics,
    finite_or_zero,
    masked_extrema,
)


def rejection(
    b: CorrectionViews, lc: Tensor, rho: Tensor, config: RolloutCorrectionConfig, sink: MetricSink
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

    lc: Tensor  # (B, T) clampS(log_ratio), 0 on padding
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


def _token_option(b: CorrectionViews, sh: _Shared, opt: RSOption) -> tuple[Tensor, RSStats]:
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


def _sequence_option(b: CorrectionViews, sh: _Shared, opt: RSOption) -> tuple[Tensor, RSStats]:
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
