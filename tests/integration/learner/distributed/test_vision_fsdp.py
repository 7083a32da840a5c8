"""A tiny Qwen2.5-VL on 2 ranks (torchrun, FSDP2 over its vision blocks and decoder layers, gloo on CPU)
trains on groups that show images like one process: the leader reads the images from the buffer and hands
them to the follower with the groups; the same weights, the vision tower untouched."""

from __future__ import annotations

import pytest

from offpolicy.learner.model import load_model, make_tiny_vl_model
from tests.integration.learner.distributed.test_fsdp import TOLERANCE, make_config, one_then_two
from tests.integration.learner.test_vision_step import vl_groups

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_two_ranks_train_a_vision_language_policy_like_one_process(redis_url, tmp_path):
    model = make_tiny_vl_model(tmp_path / "vl")
    groups, images = vl_groups(model, 12, seed=3)  # 3 steps of 4 groups
    kw = {"rollout_correction": "decoupled_token_is", "optimizer": {"lr": 1e-3}}
    one = make_config(model, redis_url, tmp_path, "one", **kw)
    two = make_config(model, redis_url, tmp_path, "two", **kw)
    expected, _, got = one_then_two(one, two, groups, redis_url, tmp_path, images=images)
    assert sorted(got) == sorted(expected)
    assert max(float((got[k] - v).abs().max()) for k, v in expected.items()) <= TOLERANCE
    start = load_model(model, "cpu").state_dict()
    moved = {k for k, v in got.items() if float((v - start[k]).abs().max()) > 0}
    assert moved and not any("visual" in k for k in moved)  # the language model trained, the tower frozen
