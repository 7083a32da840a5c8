"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.learner.rl.advantages import compute_advantages, gae, grpo, reinforce, rloo

REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 4.0, 5.0])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 9])
MASK = torch.tensor([[1, 1, 0]] * 6 + [[1, 0, 0]], dtype=torch.bool)


def per_completion(adv: torch.Tensor) -> list[float]:
    return adv[:, 0].tolist()


def test_grpo_normalizes_by_unbiased_group_std():
    adv = grpo(REWARDS, GROUPS, MASK)
    s0 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1, 0]
    expected = [0.5 / (s0 + 1e-6), -0.5 / (s0 + 1e-6)] * 2 + [
        -1 / (math.sqrt(2) + 1e-6),
        1 / (math.sqrt(2) + 1e-6),
    ]
    expected.append(5.0 / (1.0 + 1e-6))  # a group of one: mean 0, std 1 (verl)
    assert per_completion(adv) == pytest.approx(expected, rel=1e-6)
    assert torch.equal(adv[:, 2], torch.zeros(7)) and adv[6, 1] == 0  # padding is 0


def test_grpo_without_std_is_mean_centred():
    adv = grpo(REWARDS, GROUPS, MASK, norm_by_std=False)
    assert per_completion(adv) == pytest.approx([0.5, -0.5, 0.5, -0.5, -1.0, 1.0, 5.0])


def test_rloo_subtracts_the_mean_of_the_others():
    adv = rloo(REWARDS, GROUPS, MASK)
    assert per_completion(adv) == pytest.approx([1 - 1 / 3, -2 / 3, 1 - 1 / 3, -2 / 3, -2.0, 2.0, 5.0])


def test_reinforce_subtracts_the_batch_mean():
    adv = reinforce(REWARDS, GROUPS, MASK)
    assert per_completion(adv) == pytest.approx([r - 13 / 7 for r in REWARDS.tolist()])
    assert adv[0].tolist() == pytest.approx([1 - 13 / 7, 1 - 13 / 7, 0.0])


def test_dispatch_by_name():
    assert torch.equal(compute_advantages("rloo", REWARDS, GROUPS, MASK), rloo(REWARDS, GROUPS, MASK))
    with pytest.raises(ValueError, match="Unknown advantage estimator 'gae'"):
        compute_advantages("gae", REWARDS, GROUPS, MASK)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=2: delta 0.5; t=1: delta -0.05, A = -0.05 + 0.72*0.5 = 0.31; t=0: A = -0.05 + 0.72*0.31
    raw = [0.1732, 0.31, 0.5]
    torch.testing.assert_close(ret[0, :3], torch.tensor([r + 0.5 for r in raw]))
    mean = sum(raw) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in raw) / 2)
    torch.testing.assert_close(
        adv[0, :3], torch.tensor([(r - mean) / std for r in raw]), rtol=1e-5, atol=1e-5
    )
