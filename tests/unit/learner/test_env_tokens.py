"""Environment tokens (tool results, user turns) in a completion: attended, never trained. The correction and
GAE on a completion with environment tokens equal the same on its policy tokens alone; an all-policy mask is
today's batch exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from offpolicy.learner.batch import collate
from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction
from offpolicy.learner.rl.advantages import gae, token_rewards
from tests.unit.learner.rl.test_microbatches import ragged_groups


def with_env(groups, seed: int):
    """The groups with 1-2 environment spans in every completion of 6+ tokens (a policy token kept first)."""
    rng = np.random.default_rng(seed)
    for g in groups:
        for t in g.trajectories:
            n = len(t.response_ids)
            if n < 6:
                continue
            mask = np.ones(n, dtype=bool)
            for _ in range(int(rng.integers(1, 3))):
                start = int(rng.integers(1, n - 1))
                mask[start : start + int(rng.integers(1, 4))] = False
            t.policy_mask = mask
    return groups


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's values on `mask` moved to the front (the row without its environment tokens)."""
    out, m = torch.zeros_like(x), torch.zeros_like(mask)
    for b in range(x.shape[0]):
        kept = x[b][mask[b] > 0]
        out[b, : len(kept)], m[b, : len(kept)] = kept, 1
    return out, m


def test_environment_tokens_are_attended_but_not_trained():
    groups = with_env(ragged_groups(3, 2, seed=1, response=(6, 20)), seed=2)
    batch = collate(groups, 0)
    for b, t in enumerate(t for g in groups for t in g.trajectories):
        n = len(t.response_ids)
        expected = torch.ones(n) if t.policy_mask is None else torch.from_numpy(t.policy_mask).float()
        assert torch.equal(batch.response_mask[b, :n], expected)
        assert torch.equal(batch.sampled_mask[b, :n], expected)
        assert batch.attention_mask[b, batch.prompt_width : batch.prompt_width + n].all()  # attended
        assert (batch.behavior_logprobs[b, :n][expected == 0] == 0).all()
    assert batch.response_mask.sum() < batch.attention_mask[:, batch.prompt_width :].sum()


def test_an_all_policy_mask_is_todays_batch():
    plain = ragged_groups(2, 3, seed=3)
    masked = ragged_groups(2, 3, seed=3)
    for g in masked:
        for t in g.trajectories:
            t.policy_mask = np.ones(len(t.response_ids), dtype=bool)
    a, b = collate(plain, 0), collate(masked, 0)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name


@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs", "decoupled_geo_rs_seq_tis", "decoupled_token_is"])
def test_the_correction_sees_the_policy_tokens_alone(preset):
    """IS weights, the RS mask and every metric on completions with environment tokens equal those of the
    same completions with their environment tokens removed."""
    batch = collate(with_env(ragged_groups(4, 4, seed=5, response=(6, 30)), seed=6), 0)
    mask = batch.response_mask
    old = batch.behavior_logprobs + torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * 0.3
    old = old * mask - 20.0 * (1 - mask)  # environment positions: values that would matter if read
    rollout = batch.behavior_logprobs - 30.0 * (1 - mask)
    cfg = getattr(RolloutCorrectionConfig, preset)()
    full = compute_rollout_correction(old, rollout, mask, cfg)
    (c_old, c_mask), (c_rollout, _) = compact(old, mask), compact(rollout, mask)
    alone = compute_rollout_correction(c_old, c_rollout, c_mask, cfg)
    torch.testing.assert_close(compact(full.weights, mask)[0], compact(alone.weights, c_mask)[0])
    torch.testing.assert_close(
        compact(full.response_mask.float(), mask)[0], alone.response_mask.float() * c_mask
    )
    assert full.metrics.keys() == alone.metrics.keys()
    for key, value in full.metrics.items():
        assert value == pytest.approx(alone.metrics[key], rel=1e-5, abs=1e-6), key


def test_gae_bootstraps_over_environment_tokens_and_rewards_the_last_policy_token():
    batch = collate(with_env(ragged_groups(2, 3, seed=7, response=(6, 15)), seed=8), 0)
    mask = batch.sampled_mask
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    rewards = token_rewards(batch.rewards, mask)
    last = mask.cumsum(-1).argmax(-1)  # each row's last policy token
    assert torch.equal(rewards.nonzero()[:, 1], last[batch.rewards != 0])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    c_rewards, c_mask = compact(rewards, mask)
    c_adv, c_ret = gae(c_rewards, compact(values, mask)[0], c_mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(compact(adv, mask)[0], c_adv * c_mask)
    torch.testing.assert_close(compact(ret, mask)[0], c_ret * c_mask)
