"""Parity with verl 0.9.1 itself: weights, masks and every metric, key by key, on random ragged batches.

verl is installed with `--no-deps` (Makefile) and loaded by `benchmarks/verl_oracle.py`; the tests skip
with a reason when it is absent. Configurations are the ones where the DECISIONS do not change the
result (symmetric k1 specs, token / sequence levels), plus an asymmetric k1 spec ported as
docs/rollout_correction.md says ("l_u" in verl = "(1/u)_(1/l)" here).
"""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction
from verl_oracle import load_verl

ORACLE = load_verl()
pytestmark = pytest.mark.skipif(ORACLE is None, reason="verl==0.9.1 is not installed (pip install --no-deps)")
OURS_ONLY = {"rollout_corr/rollout_is_veto_fraction", "rollout_corr/rollout_is_catastrophic_token_fraction"}


def random_batch(seed: int, b: int = 8, t: int = 24, scale: float = 0.4, mask_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, t + 1, (b,), generator=gen)
    lens[0] = max(int(lens[0]), 1)  # verl needs one valid token
    lens[1] = 0  # and we want an empty row
    mask = (torch.arange(t)[None] < lens[:, None]).to(mask_dtype)
    rollout = -torch.rand(b, t, generator=gen) * 3
    train = rollout + scale * torch.randn(b, t, generator=gen)
    return train, rollout, mask


def verl_call(train, rollout, mask, **cfg):
    assert ORACLE is not None
    proto, new_mask, metrics = ORACLE.helper.compute_rollout_correction_and_rejection_mask(
        train, rollout, mask, **{"rollout_is": None, **cfg}
    )
    return (None if proto is None else proto.batch["rollout_is_weights"]), new_mask, metrics


def assert_same(ours, theirs):
    weights, new_mask, metrics = theirs
    assert (ours.weights is None) == (weights is None)
    if weights is not None:
        torch.testing.assert_close(ours.weights, weights.float(), rtol=1e-5, atol=1e-6)
    assert ours.response_mask.dtype == new_mask.dtype
    assert torch.equal(ours.response_mask, new_mask)
    mine = {k: v for k, v in ours.metrics.items() if k not in OURS_ONLY}
    assert set(mine) == set(metrics)
    for key, value in metrics.items():
        assert mine[key] == pytest.approx(value, rel=2e-5, abs=2e-6), key


CONFIGS = [
    {},
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "token", "rollout_is_threshold": "1.5"},
    {"rollout_is": "sequence", "rollout_is_threshold": 5.0},
    {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True},
    {"rollout_is": "token", "rollout_is_threshold": "0.5_1.5"},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.2_3.0", "rollout_is_batch_normalize": True},
    {"rollout_is": "token", "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.8_1.25,0.1"},
    {"rollout_rs": "token_k1,seq_max_k3", "rollout_rs_threshold": "0.4_2.5,3.0"},
    *[
        {"rollout_rs": o, "rollout_rs_threshold": "0.5_2.0"}
        for o in ("token_k1", "seq_sum_k1", "seq_mean_k1")
    ],
    *[{"rollout_rs": o, "rollout_rs_threshold": 1.3} for o in ("token_k1", "seq_sum_k1", "seq_mean_k1")],
    *[
        {"rollout_rs": o, "rollout_rs_threshold": u}
        for o in (
            "token_k2",
            "token_k3",
            "seq_sum_k2",
            "seq_sum_k3",
            "seq_mean_k2",
            "seq_mean_k3",
            "seq_max_k2",
        )
        for u in (0.05, 0.5)
    ],
    {"rollout_rs": "seq_max_k3", "rollout_rs_threshold": 0.3},
    {"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "metrics"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_verl_on_ragged_batches(cfg, seed):
    train, rollout, mask = random_batch(seed)
    ours = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**cfg))
    assert_same(ours, verl_call(train, rollout, mask, **cfg))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_matches_verl_with_large_log_ratios_and_mask_dtypes(mask_dtype):
    # Log-ratios past the +-20 safety bound, sequence sums far past it.
    train, rollout, mask = random_batch(5, scale=12.0, mask_dtype=mask_dtype)
    cfg = {"rollout_is": "sequence", "rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "3.0,50.0"}
    ours = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**cfg))
    assert_same(ours, verl_call(train, rollout, mask, **cfg))


def extreme_batch(train_dtype, rollout_dtype, seed=21):
    """A ragged batch whose log-ratios reach ~90-130: exp(lr) is past float32's range, k3_kl is not."""
    train, rollout, mask = random_batch(seed, scale=3.0)
    train[0, 0] = rollout[0, 0] + 90.0  # e^90 ~ 1.2e39 > float32 max; / valid tokens ~ 1e37 fits
    train[2, :3] = rollout[2, :3] + torch.tensor([100.0, -40.0, 130.0])
    mask[2, :3] = 1
    return train.to(train_dtype), rollout.to(rollout_dtype), mask


F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize("dtypes", [(F64, F64), (F32, F64), (F64, F32)], ids=["64-64", "32-64", "64-32"])
@pytest.mark.parametrize("option", ["token_k2", "token_k3", "seq_mean_k3", "seq_max_k2"])
def test_extreme_log_ratios_keep_float64_diagnostics_finite_as_verl(dtypes, option):
    # A float64 input makes verl compute k3_kl (and the perplexities) in float64: finite where
    # exp(lr) overflows float32. Ours used to compute them in float32 and report inf.
    train, rollout, mask = extreme_batch(*dtypes)
    cfg = {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": option,
        "rollout_rs_threshold": 0.5,
    }
    ours = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**cfg))
    theirs = verl_call(train, rollout, mask, **cfg)
    assert math.isfinite(theirs[2]["rollout_corr/k3_kl"])
    assert math.isfinite(ours.metrics["rollout_corr/k3_kl"])
    assert_same(ours, theirs)


@pytest.mark.parametrize("dtypes", [(F64, F64), (F32, F64), (F32, F32)], ids=["64-64", "32-64", "32-32"])
def test_sequence_is_min_past_float32_range_as_verl(dtypes):
    # verl's rollout_is_min at sequence level is exp(min row sum of log rho), unclamped, in the input
    # dtype: every row's sum here is ~120, so it is ~1e52 with a float64 input and inf in float32.
    gen = torch.Generator().manual_seed(3)
    rollout = -torch.rand(4, 6, generator=gen) * 3
    train, mask = rollout + 20.0 + torch.rand(4, 6, generator=gen), torch.ones(4, 6)
    train, rollout = train.to(dtypes[0]), rollout.to(dtypes[1])
    cfg = {"rollout_is": "sequence", "rollout_is_threshold": 2.0}
    ours = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**cfg))
    theirs = verl_call(train, rollout, mask, **cfg)
    expect_finite = F64 in dtypes
    assert math.isfinite(theirs[2]["rollout_corr/rollout_is_min"]) == expect_finite
    assert math.isfinite(ours.metrics["rollout_corr/rollout_is_min"]) == expect_finite
    assert_same(ours, theirs)


def test_extreme_log_ratios_in_float32_overflow_as_verl():
    # Both float32: verl computes exp(lr) in float32 too, so both report inf (no float64 promotion).
    train, rollout, mask = extreme_batch(F32, F32)
    cfg = {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k3",
        "rollout_rs_threshold": 0.5,
    }
    ours = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**cfg))
    theirs = verl_call(train, rollout, mask, **cfg)
    assert math.isinf(theirs[2]["rollout_corr/k3_kl"]) and math.isinf(ours.metrics["rollout_corr/k3_kl"])
    assert_same(ours, theirs)


@pytest.mark.parametrize("option", ["token_k1", "seq_sum_k1", "seq_mean_k1"])
def test_ported_asymmetric_k1_spec_matches_verl(option):
    train, rollout, mask = random_batch(7, scale=0.3)
    lower, upper = 0.6, 1.6
    verl_cfg = {"rollout_rs": option, "rollout_rs_threshold": f"{lower}_{upper}"}
    ours_cfg = {"rollout_rs": option, "rollout_rs_threshold": f"{1 / upper}_{1 / lower}"}
    ours = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**ours_cfg))
    assert_same(ours, verl_call(train, rollout, mask, **verl_cfg))
    if option == "token_k1":  # unported, the same string keeps another set (DECISION 3) on this batch
        unported = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(**verl_cfg))
        assert not torch.equal(unported.response_mask, ours.response_mask)


def test_geometric_level_equals_seq_mean_of_log_ratio_through_verl_sequence_level():
    # verl has no geometric level; with one valid token per row, geometric and sequence coincide.
    train, rollout, _ = random_batch(9)
    mask = torch.zeros_like(train)
    mask[:, 0] = 1
    ours = compute_rollout_correction(train, rollout, mask, RolloutCorrectionConfig(rollout_is="geometric"))
    theirs = verl_call(train, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0)
    torch.testing.assert_close(ours.weights, theirs[0], rtol=1e-5, atol=1e-6)
    assert math.isclose(
        ours.metrics["rollout_corr/rollout_is_mean"], theirs[2]["rollout_corr/rollout_is_mean"], rel_tol=1e-5
    )


# --- losses and advantages against core_algos


class _ActorConfig(dict):
    """The dict-like ActorConfig that compute_policy_loss_vanilla reads."""

    def __getattr__(self, name):
        return self[name]


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"],
)
def test_aggregate_loss_matches_agg_loss(mode):
    from offpolicy.learner.rl.losses import aggregate_loss

    train, _, mask = random_batch(11)
    assert aggregate_loss(train, mask, mode).item() == pytest.approx(
        ORACLE.core_algos.agg_loss(train, mask, mode).item(), rel=1e-6
    )


def test_ppo_clip_loss_matches_vanilla_with_weights():
    from offpolicy.learner.rl.losses import ClipConfig, compute_policy_loss

    old, rollout, mask = random_batch(12)
    new = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    w = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig.decoupled_token_is()).weights
    cfg = _ActorConfig(
        clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info={}
    )
    loss, metrics = ORACLE.core_algos.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", cfg, w)
    ours = compute_policy_loss(
        new, old, adv, mask, clip=ClipConfig(0.2, 0.15, 0.28, 3.0), rollout_is_weights=w
    )
    assert ours.loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for key, value in metrics.items():
        assert ours.metrics[key].item() == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_gae_matches_compute_gae_advantage_return():
    from offpolicy.learner.rl.advantages import gae

    values, rewards, mask = random_batch(13)
    mask[1, :3] = 1  # needs valid tokens in most rows
    adv, ret = gae(rewards, values, mask, gamma=0.95, lam=0.9)
    v_adv, v_ret = ORACLE.core_algos.compute_gae_advantage_return(rewards, values, mask, 0.95, 0.9)
    torch.testing.assert_close(ret, v_ret)
    torch.testing.assert_close(adv, v_adv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_outcome_advantages_match(name):
    import numpy as np

    from offpolicy.learner.rl.advantages import grpo, rloo

    gen = torch.Generator().manual_seed(14)
    rewards = torch.randn(10, generator=gen)
    index = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    mask = torch.ones(10, 4)
    mask[:, 3] = 0
    token_rewards = torch.zeros(10, 4)
    token_rewards[:, 2] = rewards
    fn = getattr(ORACLE.core_algos, f"compute_{name}_outcome_advantage")
    theirs, _ = fn(token_rewards, mask, index)
    ours = (grpo if name == "grpo" else rloo)(rewards, torch.from_numpy(index), mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
