"""The learner trains the policy's tokens only: the environment tokens of a multi-turn completion shape the
context (other ids, another update) but their behaviour log-probs never enter the update. Through the
buffer: the masks travel in the frames."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from offpolicy.learner.model import load_model
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401
from tests.integration.learner.test_packing import train
from tests.unit.learner.rl.test_microbatches import ragged_groups
from tests.unit.learner.test_env_tokens import with_env

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "rows"])
def test_environment_tokens_shape_the_context_but_are_never_trained(packing, tiny_dir, redis_url, tmp_path):  # noqa: F811
    base = with_env(ragged_groups(8, 3, seed=31, response=(8, 30)), seed=32)
    other_lps, other_ids = copy.deepcopy(base), copy.deepcopy(base)
    for g_lp, g_id in zip(other_lps, other_ids, strict=True):
        for t_lp, t_id in zip(g_lp.trajectories, g_id.trajectories, strict=True):
            if t_lp.policy_mask is None:
                continue
            env = ~t_lp.policy_mask
            t_lp.behavior_logprobs = np.where(env, -25.0, t_lp.behavior_logprobs).astype(np.float32)
            t_id.response_ids = np.where(env, (t_id.response_ids + 7) % 97 + 4, t_id.response_ids).astype(
                np.int32
            )
    weights = {}
    for name, groups in (("base", base), ("other_lps", other_lps), ("other_ids", other_ids)):
        cfg = config(
            tiny_dir, redis_url, tmp_path / name, groups_per_step=4, packing=packing, micro_batch_size=3,
            micro_batch_tokens=150, rollout_correction="decoupled_token_is", optimizer={"lr": 1e-2},
            buffer={"sampler": "fifo", "max_times_sampled": 1}, checkpoint={"checkpoint_dir": None},
        )  # fmt: skip
        _, weights[name], _ = train(cfg, groups)
    same = max((weights["base"][n] - weights["other_lps"][n]).abs().max().item() for n in weights["base"])
    moved = max((weights["base"][n] - weights["other_ids"][n]).abs().max().item() for n in weights["base"])
    initial = dict(load_model(tiny_dir, "cpu").named_parameters())
    assert max((weights["base"][n] - initial[n].detach()).abs().max().item() for n in initial) > 1e-3
    assert same == 0.0  # environment log-probs never read
    assert moved > 1e-4  # environment ids attended
