"""aggregate_loss (five modes, global denominators, empty masks) and compute_policy_loss, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction
from offpolicy.learner.rl.losses import ClipConfig, aggregate_loss, compute_policy_loss

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),
        ("token-sum", 7.0),
        ("seq-mean-token-sum", 3.5),
        ("seq-mean-token-sum-norm", 3.5 / 3),
        ("seq-mean-token-mean", (1.5 + 4.0) / 2),
    ],
)
def test_aggregation_modes(mode, expected):
    assert aggregate_loss(L, MASK, mode).item() == pytest.approx(expected)
    assert aggregate_loss(L, MASK.bool(), mode).item() == pytest.approx(expected)


def test_global_denominators_for_gradient_accumulation():
    assert aggregate_loss(L, MASK, "token-mean", batch_num_tokens=14).item() == pytest.approx(0.5)
    assert aggregate_loss(L, MASK, "seq-mean-token-sum", global_batch_size=4).item() == pytest.approx(7 / 4)
    assert aggregate_loss(L, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(
        0.5
    )


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"],
)
def test_empty_mask_gives_zero_loss_and_zero_gradient(mode):
    loss_mat = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], requires_grad=True)
    loss = aggregate_loss(loss_mat, torch.zeros(2, 2), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(loss_mat.grad, torch.zeros(2, 2))


def test_invalid_mode_raises():
    with pytest.raises(ValueError, match="Invalid loss_agg_mode: token-max"):
        aggregate_loss(L, MASK, "token-max")


def test_ppo_clip_asymmetric_and_dual_clip_by_hand():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 5.0, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = compute_policy_loss(new, old, adv, mask, clip=ClipConfig(clip_ratio_low=0.1, clip_ratio_high=0.3))
    # per token: max(-1.5, -1.3) = -1.3; max(0.5, 0.9) = 0.9; max(5, 1.3) = 5 -> dual clip min(3, 5) = 3
    assert out.loss.item() == pytest.approx((-1.3 + 0.9 + 3.0) / 3)
    m = out.metrics
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 3)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert m["actor/ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 3)
    out.loss.backward()
    # Every valid token sits on a clip (0.9, 1.3) or the dual clip (3): the gradient is zero.
    assert torch.equal(new.grad, torch.zeros(1, 4))


def test_unclipped_gradient_is_minus_advantage_times_ratio_times_weight():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.1, 0.95, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    w = torch.tensor([[0.5, 2.0, 1.0]])
    out = compute_policy_loss(new, old, adv, torch.tensor([[1.0, 1.0, 0.0]]), rollout_is_weights=w)
    assert out.loss.item() == pytest.approx((-2.0 * 1.1 * 0.5 + 1.0 * 0.95 * 2.0) / 2)
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-2.0 * 1.1 * 0.5 / 2, 0.95 * 2.0 / 2, 0.0]]))


def test_icepop_ppo_loss_example_of_the_spec():
    old = torch.full((1, 3), -1.0)
    rollout = torch.tensor([[-0.5, -3.5, -0.8]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    corr = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig.decoupled_token_icepop())
    torch.testing.assert_close(corr.weights, torch.tensor([[0.60653067, 0.0, 0.81873075]]))
    out = compute_policy_loss(old.clone(), old, adv, corr.response_mask, rollout_is_weights=corr.weights)
    assert out.loss.item() == pytest.approx((-0.60653067 + 0.0 - 2 * 0.81873075) / 3, rel=1e-6)


def test_bypass_reinforce_uses_weights_and_rs_mask_and_returns_tensor_metrics():
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    lp = torch.log(torch.tensor([[0.6, 0.4, 0.5], [0.5, 0.05, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3)
    cfg = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0",
        bypass_mode=True,
        loss_type="reinforce",
    )
    out = compute_policy_loss(lp, None, adv, mask, behavior_logprobs=rollout, correction=cfg)
    # rho = [1.2, 0.8, 1], [1, 0.1, 1]; token_k1 rejects 0.1; weights are rho truncated at 2.
    assert out.response_mask.tolist() == [[1, 1, 1], [1, 0, 1]]
    w = torch.tensor([[1.2, 0.8, 1.0], [1.0, 0.1, 1.0]])
    expected = (-(w * adv * lp.detach()) * out.response_mask).sum() / 5
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, -(adv * w) * out.response_mask / 5)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.metrics.values())
    kl = (rollout - lp.detach())[out.response_mask.bool()].mean()
    assert out.metrics["actor/ppo_kl"].item() == pytest.approx(kl.item(), rel=1e-5)
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(1 / 6)


def test_bypass_ppo_clip_is_ppo_against_rollout_without_weights():
    rollout = torch.full((1, 3), -1.0)
    lp = (rollout + torch.tensor([[0.1, -0.05, 2.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 1.0]])
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.05, bypass_mode=True)
    out = compute_policy_loss(lp, None, adv, torch.ones(1, 3), behavior_logprobs=rollout, correction=cfg)
    plain = compute_policy_loss(lp, rollout, adv, torch.ones(1, 3))
    assert out.loss.item() == pytest.approx(plain.loss.item())
    assert out.metrics["rollout_corr/rollout_is_max"].item() == pytest.approx(1.05)  # metrics only


def test_bypass_without_behavior_logprobs_raises():
    with pytest.raises(ValueError, match="bypass_mode=True requires behavior_logprobs"):
        compute_policy_loss(
            torch.zeros(1, 2),
            None,
            torch.zeros(1, 2),
            torch.ones(1, 2),
            correction=RolloutCorrectionConfig.bypass_ppo_clip(),
        )


def test_all_rejected_micro_batch_gives_zero_loss_and_gradient():
    rollout = torch.zeros(2, 2)
    lp = torch.full((2, 2), -5.0, requires_grad=True)
    cfg = RolloutCorrectionConfig(
        rollout_rs="token_k1", rollout_rs_threshold=2.0, bypass_mode=True, loss_type="reinforce"
    )
    out = compute_policy_loss(
        lp, None, torch.ones(2, 2), torch.ones(2, 2), behavior_logprobs=rollout, correction=cfg
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(2, 2))
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(1.0)


def test_micro_batch_accumulation_equals_the_mini_batch_loss_in_seq_mean_token_sum_norm():
    """Rows of 3, 1, 2, 1 valid tokens (T = 3), advantages 1, -2, 0.5, 4, ratio 1 so the per-token loss is
    -A. Row sums -3, 2, -1, -4: the mini-batch loss is (-6 / 4 rows) / T=3 = -0.5. Micro-batches of rows
    [0, 1] (width 3) and [2, 3] (trimmed to width 2) give -1/12 and -5/12 only when both divide by the
    mini-batch's T (`loss_scale_factor=3`); each gradient is -A * m / (4 * 3)."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=torch.float64)[:, None] * mask  # (4, 3)
    base = torch.log(torch.tensor([[0.5, 0.25, 0.2], [0.1, 0.3, 0.3], [0.9, 0.6, 0.3], [0.7, 0.2, 0.1]]))
    mode = "seq-mean-token-sum-norm"

    full_lp = base.double().clone().requires_grad_(True)
    full = compute_policy_loss(full_lp, full_lp.detach(), adv, mask, loss_agg_mode=mode).loss
    full.backward()

    acc_lp = base.double().clone().requires_grad_(True)
    den = {"batch_num_tokens": mask.sum(), "global_batch_size": 4.0, "loss_scale_factor": 3.0}
    parts = []
    for rows, width in (([0, 1], 3), ([2, 3], 2)):  # the second micro-batch trims its padding column
        lp = acc_lp[rows, :width]
        out = compute_policy_loss(
            lp, lp.detach(), adv[rows, :width], mask[rows, :width], loss_agg_mode=mode, **den
        )
        out.loss.backward()
        parts.append(out.loss.detach())

    assert float(full.detach()) == pytest.approx(-0.5, abs=1e-15)
    assert [float(p) for p in parts] == pytest.approx([-1 / 12, -5 / 12], abs=1e-15)
    assert float(parts[0] + parts[1]) == pytest.approx(float(full.detach()), abs=1e-15)
    want_grad = -adv / 12.0  # (4, 3); zero at padding
    torch.testing.assert_close(full_lp.grad, want_grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(acc_lp.grad, want_grad, rtol=0, atol=1e-15)
    # without the mini-batch's T the trimmed micro-batch divides by 2: -5/8, and the sum is wrong
    lp = acc_lp.detach()[[2, 3], :2]
    wrong = compute_policy_loss(
        lp,
        lp,
        adv[[2, 3], :2],
        mask[[2, 3], :2],
        loss_agg_mode=mode,
        batch_num_tokens=7.0,
        global_batch_size=4.0,
    ).loss
    assert float(wrong) == pytest.approx(-5 / 8, abs=1e-15)
