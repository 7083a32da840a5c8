"""A tiny Qwen3-MoE through the real learner: it trains with the router losses on (routers moving, the losses
reported), checkpoints, resumes to the same weights and version, and publishes versions that load into a
fresh transformers model under the checkpoint's per-expert names."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model, make_tiny_moe_model
from offpolicy.learner.trainer import Learner
from offpolicy.weights.record import PolicyStore
from tests.integration.learner.test_loop import config, make_groups

pytestmark = pytest.mark.redis
TINY_MOE = {"hidden_size": 64, "num_heads": 1, "num_layers": 2, "num_experts": 4, "moe_intermediate_size": 32}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe") / "model", **TINY_MOE)


def routers(model: torch.nn.Module) -> list[torch.Tensor]:
    return [layer.mlp.gate.weight.detach().clone() for layer in model.model.layers]


def test_moe_policy_trains_checkpoints_resumes_and_publishes(moe_dir, redis_url, tmp_path):
    behaviour = load_model(moe_dir, "cpu").eval()
    cfg = config(
        moe_dir, redis_url, tmp_path, metrics_jsonl=str(tmp_path / "m.jsonl"),
        moe={"aux_loss_coef": 0.01, "z_loss_coef": 0.001}, buffer={"max_times_sampled": 4},
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(make_groups(behaviour, 4, version=0, temperature=0.9))
    start = routers(behaviour)
    learner = Learner(cfg)
    try:
        steps = [learner.step() for _ in range(2)]
        trained = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    finally:
        learner.close()
    for m in steps:
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
        assert 1.5 < m["moe/aux_loss"] < 2.5 and m["moe/z_loss"] > 0  # E sum f P: ~top_k = 2, near uniform
    assert any(not torch.equal(a, b) for a, b in zip(start, routers(learner.model), strict=True))
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert all("moe/aux_loss" in r and "moe/z_loss" in r for r in lines)

    record = PolicyStore(redis_url, cfg.run_id).read()
    assert record is not None and record.version == 2
    with safe_open(f"{record.weights_uri}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys  # the checkpoint's names, per expert
    assert not any(k.endswith("gate_up_proj") for k in keys)
    loaded = AutoModelForCausalLM.from_pretrained(record.weights_uri)
    for name, q in loaded.state_dict().items():
        assert torch.equal(trained[name], q), name

    resumed = Learner(cfg)  # the checkpoint of step 2 (checkpoint_every 2)
    try:
        assert resumed.version == 2
        for name, p in resumed.model.state_dict().items():
            assert torch.equal(trained[name], p), name
        assert resumed.model.config._experts_implementation == "grouped_mm"
        assert np.isfinite(resumed.step()["moe/aux_loss"])  # and it trains on
        assert resumed.version == 3
    finally:
        resumed.close()
