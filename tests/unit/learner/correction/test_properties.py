"""Property tests (hypothesis) of the rollout correction and the policy loss."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction
from offpolicy.learner.rl.losses import compute_policy_loss

finite = st.floats(-30.0, 0.0, allow_nan=False, width=32)


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    train = torch.tensor(draw(st.lists(finite, min_size=b * t, max_size=b * t))).view(b, t)
    rollout = torch.tensor(draw(st.lists(finite, min_size=b * t, max_size=b * t))).view(b, t)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).view(b, t)
    return train, rollout, mask


configs = st.sampled_from(
    [
        RolloutCorrectionConfig(),
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0),
        RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=3.0),
        RolloutCorrectionConfig(rollout_is="geometric", rollout_is_threshold=1.5),
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_5.0"),
        RolloutCorrectionConfig(
            rollout_is="token", rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.6_1.6,2.5"
        ),
        RolloutCorrectionConfig(
            rollout_is="sequence",
            rollout_is_batch_normalize=True,
            rollout_rs="seq_mean_k3,seq_sum_k1,token_k2",
            rollout_rs_threshold="0.01,0.5_2.0,1.0",
            rollout_token_veto_threshold=1e-4,
        ),
    ]
)


@settings(max_examples=60, deadline=None)
@given(batch=batches(), config=configs)
def test_weights_bounded_zero_on_padding_mask_never_grows_metrics_finite(batch, config):
    train, rollout, mask = batch
    res = compute_rollout_correction(train, rollout, mask, config)
    if res.weights is not None:
        assert torch.all(res.weights[~mask] == 0)
        assert torch.all(res.weights >= 0)
        if not config.rollout_is_batch_normalize:
            assert torch.all(res.weights <= config.is_bounds()[0] * (1 + 1e-6))
    assert res.response_mask.dtype == mask.dtype
    assert not torch.any(res.response_mask & ~mask)
    assert all(math.isfinite(v) for v in res.metrics.values()), res.metrics


@settings(max_examples=40, deadline=None)
@given(
    batch=batches(), mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
)
def test_loss_gradient_is_zero_where_mask_is_zero(batch, mode):
    train, rollout, mask = batch
    lp = train.clone().requires_grad_(True)
    adv = torch.linspace(-1, 1, train.numel()).view_as(train)
    cfg = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_rs="token_k1",
        rollout_rs_threshold=3.0,
        bypass_mode=True,
        loss_type="reinforce",
    )
    out = compute_policy_loss(
        lp, None, adv, mask.float(), loss_agg_mode=mode, behavior_logprobs=rollout, correction=cfg
    )
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.all(lp.grad[~out.response_mask.bool()] == 0)
    decoupled = compute_policy_loss(lp, rollout, adv, mask, loss_agg_mode=mode)
    lp.grad = None
    decoupled.loss.backward()
    assert torch.all(lp.grad[~mask] == 0)
