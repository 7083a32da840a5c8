"""The priority the learner writes back (mean |A| over tokens, IS deviation, staleness decay) and the
prioritized-replay importance weights carried by the groups into the step."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.priorities import PrioritiesConfig
from offpolicy.learner.rl.priorities import (
    WEIGHT_KEY,
    group_is_deviation,
    importance_weights,
    mean_abs_advantage,
    priority,
    row_weights,
    weighted,
)
from tests.conftest import build_group


def test_zero_variance_group_has_priority_zero() -> None:
    g = build_group(0, n=4, rewards=[1.0, 1.0, 1.0, 1.0])
    assert priority(g, 5, 0.9) == 0.0


def test_mean_abs_advantage_follows_the_estimator() -> None:
    g = build_group(0, n=4, tokens=8, rewards=[0.0, 0.0, 1.0, 1.0])
    assert mean_abs_advantage(g, "grpo", norm_by_std=False) == pytest.approx(0.5)
    std = math.sqrt(1 / 3)  # unbiased std of 0 0 1 1
    assert mean_abs_advantage(g, "grpo", norm_by_std=True) == pytest.approx(0.5 / (std + 1e-6))
    assert mean_abs_advantage(g, "rloo") == pytest.approx(2 / 3)  # |r - mean of the 3 others|
    assert mean_abs_advantage(g, "gae") == pytest.approx(0.5)


def test_longer_completions_weigh_more_in_the_token_mean() -> None:
    g = build_group(0, n=3, tokens=4, rewards=[0.0, 0.0, 3.0])  # |A| = 1, 1, 2 (grpo, no std)
    g.trajectories[2] = replace(g.trajectories[2], response_ids=g.trajectories[2].response_ids[:1])
    assert mean_abs_advantage(g, "grpo", norm_by_std=False) == pytest.approx((4 + 4 + 2) / 9)


def test_priority_decays_with_staleness_and_grows_with_is_deviation() -> None:
    g = build_group(3, n=2, rewards=[0.0, 1.0])
    base = priority(g, 3, 0.5, norm_by_std=False)
    assert base == pytest.approx(0.5)
    assert priority(g, 5, 0.5, norm_by_std=False) == pytest.approx(0.5 * 0.25)  # 2 versions stale
    assert priority(g, 1, 0.5, norm_by_std=False) == pytest.approx(0.5)  # ahead of the learner: no decay
    assert priority(g, 3, 0.5, norm_by_std=False, is_deviation=0.2) == pytest.approx(0.6)


def test_importance_weights_are_per_normalised_by_the_batch_max() -> None:
    ps, eps, alpha, beta = [0.0, 1.0, 3.0], 0.01, 0.6, 0.4
    w = importance_weights(ps, eps, alpha, beta)
    probs = [(p + eps) ** alpha for p in ps]
    probs = [x / sum(probs) for x in probs]
    n = 10  # any N: it cancels in the normalisation
    raw = [(n * p) ** -beta for p in probs]
    assert w == pytest.approx([x / max(raw) for x in raw])
    assert max(w) == pytest.approx(1.0) and min(w) > 0
    assert importance_weights(ps, eps, alpha, 0.0) == [1.0, 1.0, 1.0]  # beta 0: off
    assert importance_weights([], eps, alpha, beta) == []


def test_weights_ride_on_the_groups_in_collate_row_order() -> None:
    groups = [build_group(0, n=2, seed=1), build_group(0, n=3, seed=2)]
    carried = weighted(groups, [0.25, 1.0])
    assert carried[0].metadata[WEIGHT_KEY] == "0.25" and WEIGHT_KEY not in groups[0].metadata  # copies
    assert row_weights(carried).tolist() == [0.25, 0.25, 1.0, 1.0, 1.0]
    assert row_weights(groups).tolist() == [1.0] * 5  # none carried: 1
    assert collate(carried, 0).num_rows == 5


def test_priorities_config_is_off_by_default() -> None:
    cfg = LearnerConfig(model_path="m", run_id="r")
    assert cfg.priorities == PrioritiesConfig() and not cfg.priorities.update and cfg.priorities.beta == 0
    assert cfg.buffer.priority_alpha == 1.0
    assert torch.is_tensor(row_weights([]))


def test_group_is_deviation_is_the_masked_token_mean_of_the_absolute_log_ratio_per_group() -> None:
    log_w = torch.tensor([[0.5, 0.0, 9.0], [-0.5, -0.5, -0.5], [0.2, 0.2, 0.2]])  # (B=3, R=3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # the 9.0 is padding
    index = torch.tensor([0, 0, 1])
    assert group_is_deviation(log_w, mask, index) == pytest.approx([(0.5 + 0.0 + 1.5) / 5, 0.0])
