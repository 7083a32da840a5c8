"""compute_rollout_correction: worked examples of the spec, RS boundaries, veto, levels, batch-norm, edges."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction

P = "rollout_corr/"


def batch_from_ratios(rows: list[list[float | None]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train, rollout, mask) with rho = train/rollout given per token; None = padding (extreme junk)."""
    width = max(len(r) for r in rows)
    lr = torch.full((len(rows), width), 50.0)  # padding carries an absurd ratio: it must never matter
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        for j, rho in enumerate(row):
            if rho is not None:
                lr[i, j] = math.log(rho)
                mask[i, j] = 1.0
    rollout = torch.full_like(lr, -2.0)
    return rollout + lr, rollout, mask


def run(rows, **cfg):
    train, rollout, mask = batch_from_ratios(rows)
    return compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**cfg)), mask


def kept_rows(result) -> list[list[int]]:
    return result.response_mask.int().tolist()


# --- worked examples of spec section 8


def test_icepop_zeroes_weights_without_changing_mask():
    res, mask = run([[0.4, 0.8, 6.0]], rollout_is="token", rollout_is_threshold="0.5_5.0")
    torch.testing.assert_close(res.weights, torch.tensor([[0.0, 0.8, 0.0]]))
    assert torch.equal(res.response_mask, mask)
    assert res.metrics[P + "rollout_is_oob_ratio"] == pytest.approx(2 / 3, rel=1e-6)
    assert res.metrics[P + "rollout_is_std"] == pytest.approx(0.3771236, rel=1e-6)
    assert res.metrics[P + "rollout_is_eff_sample_size"] == pytest.approx(1 / 3, rel=1e-6)


def test_seq_fraction_high_uses_raw_weights():
    res, _ = run([[1.0, 6.0], [0.9, 1.1]], rollout_is="token", rollout_is_threshold=2.0)
    assert res.metrics[P + "rollout_is_seq_fraction_high"] == 0.5
    # Applied (truncated) weights: row 0 -> (1 + 2) / 2.
    assert res.metrics[P + "rollout_is_seq_max"] == pytest.approx(1.5)


def test_mask_mode_token_tis_with_token_k1():
    e = math.e
    res, _ = run(
        [[1 / e] * 3, [e**0.5] * 3],
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    torch.testing.assert_close(res.weights[0], torch.full((3,), 1 / e))  # not zeroed by RS
    torch.testing.assert_close(res.weights[1], torch.full((3,), e**0.5))
    assert kept_rows(res) == [[0, 0, 0], [1, 1, 1]]
    assert res.metrics[P + "rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert res.metrics[P + "rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_k1_bounds_apply_to_rho_as_documented():
    # DECISION 3: "0.6_1.6" keeps 0.6 <= rho <= 1.6 (verl keeps [0.625, 1.667]).
    res, _ = run([[0.59, 0.61, 0.63, 1.59, 1.62, 1.7]], rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")
    assert kept_rows(res) == [[0, 1, 1, 1, 0, 0]]
    # The ported form of verl's "0.6_1.6" is "(1/1.6)_(1/0.6)": verl's keep set exactly.
    res, _ = run(
        [[0.61, 0.63, 1.62, 1.7]], rollout_rs="token_k1", rollout_rs_threshold=f"{1 / 1.6}_{1 / 0.6}"
    )
    assert kept_rows(res) == [[0, 1, 1, 0]]


# --- the eleven RS options at their boundaries (padding holds rho = e^50 and is never counted)

RS_CASES = [
    # option, threshold, rows of rho (None = padding), expected kept mask
    ("token_k1", "0.5_2.0", [[0.49, 0.51, 1.99, 2.01, None]], [[0, 1, 1, 0, 0]]),
    ("token_k1", 2.0, [[0.49, 0.51, 1.99, 2.01, None]], [[0, 1, 1, 0, 0]]),
    ("token_k2", 0.5, [[math.e**0.99, math.e**-0.99, math.e**1.01, math.e**-1.01, None]], [[1, 1, 0, 0, 0]]),
    ("token_k3", 0.5, [[math.e**0.85, math.e**0.9, math.e**-1.0, math.e**-1.2, None]], [[1, 0, 1, 0, 0]]),
    (
        "seq_sum_k1",
        "0.5_3.0",
        [[1.45, 2.0, None], [1.55, 2.0, None], [0.7, 0.7, None], [0.71, 0.72, None]],
        [[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0]],
    ),
    (
        "seq_sum_k2",
        0.5,
        [[math.e**0.6, math.e**-0.7, None], [math.e**0.7, math.e**0.8, None]],
        [[1, 1, 0], [0, 0, 0]],
    ),
    (
        "seq_sum_k3",
        0.2,
        [[math.e**0.3, math.e**0.3, None], [math.e**0.5, math.e**0.4, None]],
        [[1, 1, 0], [0, 0, 0]],
    ),
    (
        "seq_mean_k1",
        "0.8_1.25",
        [[1.2 * 1.1, 1.2 / 1.1, None], [1.3, 1.3, None], [0.79, 0.79, None], [0.81 * 2, 0.81 / 2, None]],
        [[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0]],
    ),
    (
        "seq_mean_k2",
        0.1,
        [[math.e**0.4, math.e**-0.4, None], [math.e**0.5, math.e**0.4, None]],
        [[1, 1, 0], [0, 0, 0]],
    ),
    (
        "seq_mean_k3",
        0.05,
        [[math.e**0.3, math.e**0.3, None], [math.e**0.3, math.e**0.4, None]],
        [[1, 1, 0], [0, 0, 0]],
    ),
    (
        "seq_max_k2",
        0.5,
        [[math.e**0.2, math.e**-0.99, None], [math.e**0.2, math.e**-1.01, None]],
        [[1, 1, 0], [0, 0, 0]],
    ),
    (
        "seq_max_k3",
        0.5,
        [[math.e**0.1, math.e**0.85, None], [math.e**0.1, math.e**0.9, None]],
        [[1, 1, 0], [0, 0, 0]],
    ),
]


@pytest.mark.parametrize(("option", "threshold", "rows", "expected"), RS_CASES)
def test_rs_option_keeps_and_rejects_at_its_boundary(option, threshold, rows, expected):
    res, mask = run(rows, rollout_rs=option, rollout_rs_threshold=threshold)
    assert kept_rows(res) == expected
    n_valid = mask.sum().item()
    n_rejected = n_valid - torch.tensor(expected).sum().item()
    assert res.metrics[P + f"rollout_rs_{option}_masked_fraction"] == pytest.approx(n_rejected / n_valid)
    assert res.metrics[P + "rollout_rs_masked_fraction"] == pytest.approx(n_rejected / n_valid)
    assert all(math.isfinite(v) for v in res.metrics.values())


def test_seq_max_k2_means_abs_log_ratio_bound():
    # seq_max_k2 <= 2.5  <=>  |log rho| <= sqrt(5) = 2.2360...
    res, _ = run(
        [[math.exp(2.23)], [math.exp(2.24)], [math.exp(-2.23)], [math.exp(-2.24)]],
        rollout_rs="seq_max_k2",
        rollout_rs_threshold=2.5,
    )
    assert kept_rows(res) == [[1], [0], [1], [0]]


def test_multi_criteria_are_anded_and_metrics_per_option():
    res, _ = run(
        [[1.0, 1.5, 0.55], [1.0, 1.0, 12.0]],
        rollout_rs="token_k1,seq_max_k2",
        rollout_rs_threshold="0.6_1.6,2.5",
    )
    # token_k1 rejects 0.55 (< 0.6); seq_max_k2 rejects row 1 (|log 12| = 2.48 > 2.236).
    assert kept_rows(res) == [[1, 1, 0], [0, 0, 0]]
    m = res.metrics
    assert m[P + "rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 6)  # 0.55 and 12.0
    assert m[P + "rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(3 / 6)
    assert m[P + "rollout_rs_seq_max_k2_seq_masked_fraction"] == pytest.approx(0.5)
    assert m[P + "rollout_rs_masked_fraction"] == pytest.approx(4 / 6)
    assert m[P + "rollout_rs_seq_masked_fraction"] == 1.0
    assert m[P + "rollout_rs_seq_max_k2_max"] == pytest.approx(0.5 * math.log(12.0) ** 2, rel=1e-5)


# --- key counts (spec 6, plus the two veto keys that are always present)


def ragged():
    torch.manual_seed(3)
    lens = torch.tensor([12, 7, 3, 10])
    mask = (torch.arange(12)[None] < lens[:, None]).float()
    rollout = -torch.rand(4, 12) * 2
    return rollout + 0.2 * torch.randn(4, 12), rollout, mask


@pytest.mark.parametrize(
    ("cfg", "count"),
    [
        ({}, 13),
        ({"rollout_is": "token"}, 27),
        ({"rollout_is": "sequence", "rollout_is_batch_normalize": True}, 28),
        ({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}, 28),
        (
            {
                "rollout_is": "token",
                "rollout_rs": "token_k1,seq_max_k2",
                "rollout_rs_threshold": "0.6_1.6,2.5",
            },
            58,
        ),
    ],
)
def test_key_count_per_configuration(cfg, count):
    res = compute_rollout_correction(*ragged(), RolloutCorrectionConfig(**cfg))
    assert len(res.metrics) == count + 2
    assert res.metrics[P + "rollout_is_veto_fraction"] == 0.0
    assert res.metrics[P + "rollout_is_catastrophic_token_fraction"] == 0.0
    assert all(k.startswith(P) for k in res.metrics)


def test_metrics_only_leaves_mask_and_gives_no_weights():
    train, rollout, mask = ragged()
    res = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig())
    assert res.weights is None
    assert torch.equal(res.response_mask, mask) and res.response_mask is not mask
    lr = (train - rollout) * mask
    assert res.metrics[P + "kl"] == pytest.approx((-lr.sum() / mask.sum()).item(), rel=1e-5)


def test_is_level_set_but_threshold_none_skips_is_silently():
    res = compute_rollout_correction(
        *ragged(), RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=None)
    )
    assert res.weights is None and len(res.metrics) == 15


# --- veto (DECISION 4)


def test_veto_rejects_whole_rows_and_ands_with_rs():
    res, _ = run(
        [[1.0, 1e-5, 1.0], [1.0, 2e-4, 1.0], [1.0, 1.0, None], [1.0, 1.7, 1.0]],
        rollout_token_veto_threshold=1e-4,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.6_1.6",
    )
    # row 0 vetoed (1e-5 < 1e-4); row 1 loses only its 2e-4 token to RS; row 3 loses 1.7 to RS.
    assert kept_rows(res) == [[0, 0, 0], [1, 0, 1], [1, 1, 0], [1, 0, 1]]
    assert res.metrics[P + "rollout_is_veto_fraction"] == 0.25
    assert res.metrics[P + "rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 11)
    # RS metrics ignore the veto: token_k1 rejected 1e-5, 2e-4 and 1.7.
    assert res.metrics[P + "rollout_rs_masked_fraction"] == pytest.approx(3 / 11)


def test_veto_uses_unclamped_log_ratio_and_ignores_padding():
    train = torch.tensor([[0.0, -30.0, 0.0], [0.0, 0.0, -40.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    res = compute_rollout_correction(
        train, rollout, mask, RolloutCorrectionConfig(rollout_token_veto_threshold=1e-10)
    )
    # log(1e-10) = -23.03: -30 vetoes row 0 (the clamp at -20 would have hidden it); -40 is padding.
    assert res.response_mask.tolist() == [[False, False, False], [True, True, False]]
    assert res.response_mask.dtype == torch.bool


# --- IS levels and batch normalization (DECISION 5, spec 3)


def test_sequence_level_weight_is_truncated_product():
    res, _ = run([[2.0, 1.5, None], [0.5, 0.8, 1.0]], rollout_is="sequence", rollout_is_threshold=2.0)
    torch.testing.assert_close(res.weights, torch.tensor([[2.0, 2.0, 0.0], [0.4, 0.4, 0.4]]))
    assert res.metrics[P + "rollout_is_max"] == pytest.approx(3.0, rel=1e-6)  # from the raw product
    assert res.metrics[P + "rollout_is_ratio_fraction_high"] == 0.5


def test_geometric_level_weight_is_geometric_mean():
    res, _ = run(
        [[4.0, 1.0, None], [0.5, 0.5, 0.5], [8.0, 8.0, 8.0]], rollout_is="geometric", rollout_is_threshold=3.0
    )
    torch.testing.assert_close(res.weights, torch.tensor([[2.0, 2.0, 0.0], [0.5, 0.5, 0.5], [3.0, 3.0, 3.0]]))
    m = res.metrics
    assert m[P + "rollout_is_max"] == pytest.approx(8.0, rel=1e-5)
    assert m[P + "rollout_is_min"] == pytest.approx(0.5, rel=1e-5)
    assert m[P + "rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m[P + "rollout_is_mean"] == pytest.approx((4 + 1.5 + 9) / 8, rel=1e-6)


def test_geometric_icepop_zeroes_rows_out_of_range():
    res, _ = run([[4.0, 1.0], [0.1, 0.1]], rollout_is="geometric", rollout_is_threshold="0.5_3.0")
    torch.testing.assert_close(res.weights, torch.tensor([[2.0, 2.0], [0.0, 0.0]]))
    assert res.metrics[P + "rollout_is_oob_ratio"] == 0.5


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_batch_normalize_gives_mean_one_at_its_level(level):
    train, rollout, mask = ragged()
    mask[2] = 0  # an empty row must not count
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=5.0, rollout_is_batch_normalize=True)
    plain = compute_rollout_correction(
        train, rollout, mask, cfg.model_copy(update={"rollout_is_batch_normalize": False})
    )
    res = compute_rollout_correction(train, rollout, mask, cfg)
    w = res.weights
    if level == "token":
        mean = (w * mask).sum() / mask.sum()
        before = (plain.weights * mask).sum() / mask.sum()
    else:
        rows = mask.sum(-1) > 0
        mean = ((w * mask).sum(-1) / mask.sum(-1).clamp(min=1))[rows].mean()
        before = ((plain.weights * mask).sum(-1) / mask.sum(-1).clamp(min=1))[rows].mean()
    assert mean.item() == pytest.approx(1.0, rel=1e-5)
    assert res.metrics[P + "rollout_is_batch_norm_factor"] == pytest.approx(before.item(), rel=1e-5)
    torch.testing.assert_close(w, plain.weights / before)


def test_batch_normalize_with_all_zero_weights_keeps_factor_one():
    res, _ = run(
        [[9.0, 9.0]], rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True
    )
    assert res.metrics[P + "rollout_is_batch_norm_factor"] == 1.0
    assert res.weights.abs().sum() == 0


# --- empty rows, empty and rejected batches, masks and dtypes (DECISION 7)


def test_empty_rows_get_zero_weight_and_finite_metrics():
    res, _ = run(
        [[None, None], [1.5, 0.5]], rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold=2.0
    )
    assert res.weights[0].tolist() == [0.0, 0.0]
    assert res.metrics[P + "rollout_is_seq_min"] == 0.0  # the empty row has q = 0 (verl)
    assert all(math.isfinite(v) for v in res.metrics.values())


def test_all_rejected_batch_has_empty_mask_and_finite_metrics():
    res, _ = run(
        [[9.0, 9.0], [0.01, None]], rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=2.0
    )
    assert res.response_mask.sum() == 0
    assert res.metrics[P + "rollout_rs_masked_fraction"] == pytest.approx(1.0)
    assert all(math.isfinite(v) for v in res.metrics.values())


@pytest.mark.parametrize("shape", [(3, 4), (0, 4), (2, 0)])
def test_batch_without_valid_tokens_is_finite(shape):
    cfg = RolloutCorrectionConfig(
        rollout_is="sequence",
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_max_k3",
        rollout_rs_threshold="2.0,1.0",
        rollout_token_veto_threshold=1e-4,
    )
    z = torch.zeros(shape)
    res = compute_rollout_correction(z, z - 1.0, torch.zeros(shape, dtype=torch.bool), cfg)
    assert res.weights.shape == shape and res.response_mask.shape == shape
    # 13 off-policy + 14 IS + BN factor + token_k1 (15) + seq_max_k3 (14) + 2 global RS + 2 veto
    assert len(res.metrics) == 13 + 14 + 1 + 15 + 14 + 2 + 2
    assert all(math.isfinite(v) for v in res.metrics.values())


def test_bool_and_float_masks_agree_and_keep_dtype():
    train, rollout, mask = ragged()
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1")
    by_float = compute_rollout_correction(train, rollout, mask, cfg)
    by_bool = compute_rollout_correction(train, rollout, mask.bool(), cfg)
    assert by_float.response_mask.dtype == torch.float32 and by_bool.response_mask.dtype == torch.bool
    assert torch.equal(by_float.response_mask.bool(), by_bool.response_mask)
    torch.testing.assert_close(by_float.weights, by_bool.weights)
    assert by_float.metrics == pytest.approx(by_bool.metrics)


def test_bfloat16_inputs_are_computed_in_float32():
    train, rollout, mask = ragged()
    t16, r16 = train.bfloat16(), rollout.bfloat16()
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01)
    res16 = compute_rollout_correction(t16, r16, mask.bfloat16(), cfg)
    ref = compute_rollout_correction(t16.float(), r16.float(), mask, cfg)
    assert res16.weights.dtype == torch.float32 and res16.response_mask.dtype == torch.bfloat16
    torch.testing.assert_close(res16.weights, ref.weights)
    assert res16.metrics == pytest.approx(ref.metrics)


def test_weights_are_detached_even_from_grad_inputs():
    train, rollout, mask = ragged()
    train.requires_grad_(True)
    res = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(rollout_is="token"))
    assert not res.weights.requires_grad


def test_shape_mismatch_raises_with_verl_wording():
    with pytest.raises(ValueError, match="does not match rollout_log_prob shape"):
        compute_rollout_correction(
            torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), RolloutCorrectionConfig()
        )
    with pytest.raises(ValueError, match="does not match response_mask shape"):
        compute_rollout_correction(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4), RolloutCorrectionConfig()
        )
