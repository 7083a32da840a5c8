"""Rollout-correction metrics as device tensors: the IS, RS and off-policy keys of spec section 6.

Every function here appends 0-d tensors to a `MetricSink`; nothing leaves the device until
`MetricSink.to_host()` stacks them and moves them in one transfer (DECISION 8). Formulas are verl
0.9.1's (`compute_is_metrics`, `compute_rs_metrics`, `compute_offpolicy_metrics`), rewritten over row
sums and counts so that each (B, T) tensor is read as few times as possible. Where verl divides by zero
or takes a max over an empty set (a batch with no valid token, DECISION 7) the value is 0.0 instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

SAFETY_BOUND = 20.0
EPS = 1e-8


@dataclass(slots=True)
class MetricSink:
    """Named 0-d tensors (or Python floats), moved to the host together."""

    names: list[str] = field(default_factory=list)
    values: list[Tensor | float] = field(default_factory=list)

    def add(self, name: str, value: Tensor | float) -> None:
        self.names.append(name)
        self.values.append(value)

    def to_tensors(self, prefix: str = "") -> dict[str, Tensor]:
        """The metrics as detached 0-d float32 tensors on the device, for accumulation without a sync."""
        device = next((v.device for v in self.values if isinstance(v, Tensor)), None)
        return {
            prefix + name: value.reshape(()).float()
            if isinstance(value, Tensor)
            else torch.tensor(value, device=device)
            for name, value in zip(self.names, self.values, strict=True)
        }

    def to_host(self, prefix: str = "") -> dict[str, float]:
        """One device-to-host transfer for every tensor value; keys get `prefix`. Stacked as float64, so
        that float32 values are exact and float64 diagnostics past float32's range stay finite."""
        tensors = [v.reshape(()).double() for v in self.values if isinstance(v, Tensor)]
        host = iter(torch.stack(tensors).tolist() if tensors else [])
        return {
            prefix + name: (next(host) if isinstance(value, Tensor) else float(value))
            for name, value in zip(self.names, self.values, strict=True)
        }


@dataclass(slots=True)
class CorrectionViews:
    """The float32 views of one call's inputs that every metric shares.

    `log_ratio` is log pi_train - log pi_rollout (pi_rollout: the behaviour policy), forced to 0 on
    padding, so that padding contributes 0 to every sum and exp(log_ratio) = 1 there.
    """

    mb: Tensor  # (B, T) bool valid-token mask
    m: Tensor  # (B, T) float32 mask
    log_ratio: Tensor  # (B, T) unclamped, 0 on padding
    cnt: Tensor  # (B,) valid tokens per row, float32
    n: Tensor  # () valid tokens in the batch, float32
    row_valid: Tensor  # (B,) bool, row has >= 1 valid token
    n_rows: Tensor  # () number of valid rows, float32
    s_row: Tensor  # (B,) unclamped row sums of log_ratio
    s_row_v: Tensor  # (B,) the same in verl's dtype (float64 when an input is): where it is exponentiated


def mmean_total(total: Tensor, b: CorrectionViews) -> Tensor:
    """verl's masked_mean over the whole batch, given the masked sum: total / (sum(m) + 1e-8)."""
    return total / (b.n + EPS)


def masked_extrema(x: Tensor, mb: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise (max, min) of `x` over valid tokens, as (B,) tensors (+-inf for empty rows)."""
    row_max = torch.where(mb, x, float("-inf")).amax(dim=-1)
    row_min = torch.where(mb, x, float("inf")).amin(dim=-1)
    return row_max, row_min


def finite_or_zero(x: Tensor) -> Tensor:
    """Replace +-inf (a max/min over an empty set) with 0."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def masked_std_from_sums(s1: Tensor, s2: Tensor, b: CorrectionViews) -> Tensor:
    """verl's `sqrt(max(mmean(x^2) - mmean(x)^2, 0))`, 0 when sum(m) <= 1, from sum(x*m), sum(x^2*m)."""
    var = s2 / (b.n + EPS) - (s1 / (b.n + EPS)).square()
    return torch.where(b.n > 1, var.clamp(min=0.0).sqrt(), torch.zeros_like(var))


def add_seq_stats(
    sink: MetricSink, prefix: str, q: Tensor, valid: Tensor, n_valid: Tensor, centre: float
) -> None:
    """`_seq_mean/_seq_std/_seq_max/_seq_min/_seq_max_deviation` of `q` over rows where `valid`.

    std is unbiased (torch.std) and 0 for a single row; every value is 0 over an empty set. Computed in
    float64 ((B,) values, no cost): a float32 mean of nearly equal large values (k3 at the e^20 clamp,
    ~4.85e8) would leave a std of float32 rounding noise (~30) where verl's float64 gives ~0.
    """
    q = q.double()
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    qv = torch.where(valid, q, zero)
    mean = qv.sum() / n_valid.clamp(min=1.0)
    var = torch.where(valid, (q - mean).square(), zero).sum() / (n_valid - 1).clamp(min=1.0)
    sink.add(f"{prefix}_seq_mean", mean)
    sink.add(f"{prefix}_seq_std", torch.where(n_valid > 1, var.sqrt(), zero))
    sink.add(f"{prefix}_seq_max", finite_or_zero(torch.where(valid, q, float("-inf")).amax()))
    sink.add(f"{prefix}_seq_min", finite_or_zero(torch.where(valid, q, float("inf")).amin()))
    sink.add(
        f"{prefix}_seq_max_deviation", finite_or_zero(torch.where(valid, (q - centre).abs(), -1.0).amax())
    )


# --- importance-sampling metrics (spec 6.1)


@dataclass(slots=True)
class ISStats:
    """What the IS metrics need, already reduced; produced by learner/correction/compute.py for one level."""

    sum_w: Tensor  # () sum of applied weights over valid tokens
    sum_w2: Tensor  # () sum of squared applied weights over valid tokens
    row_mean_w: Tensor  # (B,) mmean_row(w), 0 for empty rows
    row_mean_raw: Tensor  # (B,) mmean_row(raw)
    w_max: Tensor  # ()
    w_min: Tensor  # ()
    n_high: Tensor  # () verl's ratio_fraction_high numerator (tokens, or rows at sequence level)
    n_low: Tensor  # ()
    frac_denominator: Tensor  # () n + 1e-8 (token level) or B (sequence level)
    n_oob: Tensor | None  # () tokens outside [L, U] (IcePop only)


def add_is_metrics(sink: MetricSink, st: ISStats, b: CorrectionViews, upper: float, lower: float) -> None:
    """The 14 IS keys (+ `rollout_is_oob_ratio` under IcePop), in verl's order."""
    mean = mmean_total(st.sum_w, b)
    sink.add("rollout_is_mean", mean)
    sink.add("rollout_is_ratio_fraction_high", st.n_high / st.frac_denominator)
    sink.add("rollout_is_ratio_fraction_low", st.n_low / st.frac_denominator)
    sink.add("rollout_is_max", st.w_max)
    sink.add("rollout_is_min", st.w_min)
    # Applied weights already lie in [0, U], so verl's clamp(w, 0, U) before std / ESS is the identity.
    sink.add("rollout_is_std", masked_std_from_sums(st.sum_w, st.sum_w2, b))
    ess_inv = mmean_total(st.sum_w2, b) / (mean + EPS).square()
    sink.add("rollout_is_eff_sample_size", torch.where(ess_inv > 0, 1.0 / ess_inv, torch.zeros_like(ess_inv)))
    all_rows = torch.ones_like(b.row_valid)
    add_seq_stats(
        sink,
        "rollout_is",
        st.row_mean_w,
        all_rows,
        torch.tensor(float(b.cnt.numel()), device=b.cnt.device),
        1.0,
    )
    sink.add("rollout_is_seq_fraction_high", (st.row_mean_raw > upper).float().mean())
    sink.add("rollout_is_seq_fraction_low", (st.row_mean_raw < lower).float().mean())
    if st.n_oob is not None:
        sink.add("rollout_is_oob_ratio", mmean_total(st.n_oob, b))


# --- rejection-sampling metrics (spec 6.2)


@dataclass(slots=True)
class RSStats:
    """One RS option's reduced statistics, from learner/correction/rejection.py."""

    name: str
    is_k1: bool
    level: str  # "token" or "sequence"
    thr_upper: float  # log-space for k1
    thr_lower: float  # log-space for k1, 0.0 otherwise
    sum_s: Tensor  # () mmean numerator of the per-token statistic
    std_s1: Tensor  # () sum of clamp(s, thrL|0, thrU) over valid tokens
    std_s2: Tensor  # () sum of its square
    q: Tensor  # (B,) row statistic (sequence) or mmean_row(s) (token)
    tok_max: Tensor | None  # () masked max of s (token level)
    tok_min: Tensor | None  # () masked min of s
    n_high: Tensor | None  # () valid tokens with s > thrU (token level)
    n_low: Tensor | None  # () valid tokens with s < thrL (token level, k1)
    n_rejected: Tensor  # () valid tokens this option rejects
    row_rejects: Tensor  # (B,) bool, valid row with >= 1 rejected valid token


def add_rs_metrics(sink: MetricSink, st: RSStats, b: CorrectionViews) -> None:
    """The per-option keys `rollout_rs_{option}_*` in verl's order."""
    p = f"rollout_rs_{st.name}"
    valid, nv = b.row_valid, b.n_rows
    zero = torch.zeros((), dtype=st.q.dtype, device=st.q.device)
    frac_v = lambda x: torch.where(valid & x, 1.0, 0.0).sum() / nv.clamp(min=1.0)  # noqa: E731
    sink.add(f"{p}_mean", mmean_total(st.sum_s, b))
    if st.level == "sequence":
        sink.add(f"{p}_max", finite_or_zero(torch.where(valid, st.q, float("-inf")).amax()))
        sink.add(f"{p}_min", finite_or_zero(torch.where(valid, st.q, float("inf")).amin()))
        sink.add(f"{p}_fraction_high", frac_v(st.q > st.thr_upper))
        sink.add(f"{p}_fraction_low", frac_v(st.q < st.thr_lower) if st.is_k1 else 0.0)
    else:
        assert st.tok_max is not None and st.tok_min is not None and st.n_high is not None
        sink.add(f"{p}_max", finite_or_zero(st.tok_max))
        sink.add(f"{p}_min", finite_or_zero(st.tok_min))
        sink.add(f"{p}_fraction_high", mmean_total(st.n_high, b))
        sink.add(f"{p}_fraction_low", mmean_total(st.n_low, b) if st.n_low is not None else 0.0)
    sink.add(f"{p}_std", masked_std_from_sums(st.std_s1, st.std_s2, b))
    add_seq_stats(sink, p, st.q, valid, nv, 0.0)
    sink.add(f"{p}_seq_fraction_high", frac_v(st.q > st.thr_upper))
    if st.is_k1:
        sink.add(f"{p}_seq_fraction_low", frac_v(st.q < st.thr_lower))
    sink.add(f"{p}_masked_fraction", mmean_total(st.n_rejected, b))
    sink.add(f"{p}_seq_masked_fraction", torch.where(st.row_rejects, 1.0, zero).sum() / nv.clamp(min=1.0))


# --- off-policy diagnostics (spec 6.3)


def add_offpolicy_metrics(
    sink: MetricSink,
    cnt: Tensor,
    s_row: Tensor,
    train_row_sum: Tensor,
    roll_row_sum: Tensor,
    k3_sum: Tensor,
    rho2_sum: Tensor,
) -> None:
    """The 13 diagnostics, each in the dtype of its inputs (float32, or float64 where verl's is).

    `cnt`: (B,) valid tokens per row; `s_row`: (B,) unclamped row sums of log rho; `train_row_sum` /
    `roll_row_sum`: (B,) masked row sums of log pi_train / log pi_rollout; `k3_sum`: sum of
    exp(r) - r - 1 over valid tokens of the log-ratio r (unclamped); `rho2_sum`: sum of exp(2 clampS(r)) over
    valid tokens."""
    n = cnt.sum()
    denom = cnt + EPS
    mu_train = train_row_sum / denom  # (B,)
    mu_roll = roll_row_sum / denom  # (B,)
    sink.add("training_ppl", torch.exp(-mu_train).mean())
    sink.add("training_log_ppl", (-mu_train).mean())
    sink.add("kl", -s_row.sum() / (n + EPS))
    sink.add("k3_kl", k3_sum / (n + EPS))
    sink.add("rollout_ppl", torch.exp(-mu_roll).mean())
    sink.add("rollout_log_ppl", (-mu_roll).mean())
    diff = mu_roll - mu_train  # (B,)
    sink.add("log_ppl_diff", diff.mean())
    sink.add("log_ppl_abs_diff", diff.abs().mean())
    sink.add("log_ppl_diff_max", diff.max())
    sink.add("log_ppl_diff_min", diff.min())
    sink.add("ppl_ratio", torch.exp(diff).mean())
    sink.add("chi2_token", rho2_sum / (n + EPS) - 1.0)
    sink.add("chi2_seq", torch.exp(2.0 * s_row.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0)
