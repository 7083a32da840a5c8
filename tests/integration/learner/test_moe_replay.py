"""Routing replay through the real learner (embedded Redis): a tiny Qwen3-MoE under `moe.routing_replay:
rollout` trains on groups carrying the behaviour model's own routed experts (agreement reported, near 1
at the behaviour's weights), and a group without routed experts in the same batch is dead-lettered by
name while its neighbours train."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model, make_tiny_moe_model, moe
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, make_groups

pytestmark = pytest.mark.redis
TINY_MOE = {"hidden_size": 64, "num_heads": 1, "num_layers": 2, "num_experts": 4, "moe_intermediate_size": 32}


def with_routes(model: torch.nn.Module, group):
    """`group` with each trajectory's routed experts as `model` routes them (row j: the position before
    response token j), as an actor capturing routing would record them."""
    router = moe.RouterLogits(model)
    trs = []
    try:
        for t in group.trajectories:
            ids = torch.as_tensor(np.concatenate([group.prompt_ids, t.response_ids]), dtype=torch.long)[None]
            with torch.no_grad(), router.counting(record=True):
                model(input_ids=ids)
            own = torch.stack(router.record, 1).numpy().astype(np.uint8)  # (T, L, K)
            p = len(group.prompt_ids)
            trs.append(dataclasses.replace(t, routed_experts=own[p - 1 : p - 1 + len(t.response_ids)]))
    finally:
        router.remove()
    return dataclasses.replace(group, trajectories=trs, num_experts=TINY_MOE["num_experts"])


def moe_learner(folder, redis_url, tmp_path, replay: str, groups_per_step: int):
    """The tiny MoE built in `folder`, its behaviour policy (eval mode) and a learner config replaying
    `replay` routing on it (no checkpoints)."""
    moe_dir = make_tiny_moe_model(folder / "model", **TINY_MOE)
    cfg = config(
        moe_dir, redis_url, tmp_path, groups_per_step=groups_per_step, checkpoint={"checkpoint_dir": None},
        moe={"routing_replay": replay},
    )  # fmt: skip
    return load_model(moe_dir, "cpu").eval(), cfg


def test_rollout_replay_trains_and_refuses_a_group_without_routes(tmp_path_factory, redis_url, tmp_path):
    behaviour, cfg = moe_learner(tmp_path_factory.mktemp("tiny_moe"), redis_url, tmp_path, "rollout", 3)
    groups = make_groups(behaviour, 3, version=0, temperature=0.9)
    routed = [with_routes(behaviour, g) for g in groups[:2]]
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many([routed[0], groups[2], routed[1]]).ok
    learner = Learner(cfg)
    try:
        metrics = learner.step()
        dead = {d["group_id"]: d for d in learner.buffer.dead_letters()}
    finally:
        learner.close()
    assert metrics["groups"] == 2.0  # the routed neighbours trained
    assert set(dead) == {groups[2].group_id}
    assert dead[groups[2].group_id]["field"] == "trajectories[0].routed_experts"
    assert 0.9 <= metrics["moe/router_agreement"] <= 1.0  # the behaviour's weights: its own choices
    assert 0 <= metrics["moe/logprob_gap"] < 0.05, metrics["moe/logprob_gap"]
    # by staleness bucket: the groups are the learner's own version's, all in bucket 0
    by_bucket = {k for k in metrics if k.startswith(("moe/router_agreement/", "moe/logprob_gap/"))}
    assert by_bucket == {"moe/router_agreement/0", "moe/logprob_gap/0"}
    assert metrics["moe/router_agreement/0"] == pytest.approx(metrics["moe/router_agreement"], abs=1e-6)
    assert metrics["moe/logprob_gap/0"] == pytest.approx(metrics["moe/logprob_gap"], rel=1e-5)


def test_old_replay_keeps_the_rollout_correction(tmp_path_factory, redis_url, tmp_path):
    """`moe.routing_replay: old` (R2) computes pi_old with its own pass: the rollout correction and the
    off-policy KL still run on it (they were skipped under `old`, found by the dashboards' scrape test)."""
    behaviour, cfg = moe_learner(tmp_path_factory.mktemp("tiny_moe_old"), redis_url, tmp_path, "old", 2)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(make_groups(behaviour, 2, version=0, temperature=0.9)).ok
    learner = Learner(cfg)
    try:
        metrics = learner.step()
    finally:
        learner.close()
    assert metrics["groups"] == 2.0
    assert any(k.startswith("rollout_corr/") for k in metrics), sorted(metrics)
    assert "offpolicy_kl/0" in metrics and "moe/router_agreement/0" in metrics
