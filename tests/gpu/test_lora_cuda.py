"""A LoRA learner on CUDA under `bf16_mixed` (skipped without a GPU; `make test-gpu` runs these): the adapter
in fp32 masters on the device beside the frozen base, the only parameters AdamW holds and the only ones that
move; the KL loss against the base model (the adapter disabled) starts at 0; checkpoint and resume restore
the adapter exactly."""

from __future__ import annotations

import pytest
import torch

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model, lora
from offpolicy.learner.trainer import Learner
from tests.gpu.test_learner_cuda import bf16_tiny  # noqa: F401 (fixture)
from tests.integration.learner.test_loop import config, covering_groups

pytestmark = [pytest.mark.gpu, pytest.mark.redis]


def test_a_lora_learner_trains_its_adapter_alone_on_cuda(bf16_tiny, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        bf16_tiny, redis_url, tmp_path, device="cuda", lora={"rank": 8}, kl_loss_coef=0.1, groups_per_step=2,
        micro_batch_size=4, optimizer={"lr": 1e-3},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2},
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(covering_groups(6, seed=1))
    base = load_model(bf16_tiny, "cpu", torch.float32).state_dict()
    learner = Learner(cfg)
    try:
        adapter = set(lora.adapter_names(learner.model))
        named = dict(learner.model.named_parameters())
        assert adapter and all(named[n].dtype == torch.float32 and named[n].is_cuda for n in adapter)
        in_adamw = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
        assert in_adamw == {id(named[n]) for n in adapter}
        start = {n: named[n].detach().clone() for n in adapter}
        metrics = [learner.step() for _ in range(2)]
        trained = {n: named[n].detach().clone() for n in adapter}
        for name, p in named.items():
            if name not in adapter:
                assert torch.equal(p.detach().cpu(), base[lora.base_name(name)]), name
    finally:
        learner.close()
    assert any(not torch.equal(trained[n], start[n]) for n in adapter)
    assert metrics[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-3)  # version 0 is the base model
    resumed = Learner(cfg)
    try:
        assert resumed.version == 2
        got = dict(resumed.model.named_parameters())
        assert all(torch.equal(got[n].detach(), t) for n, t in trained.items())
    finally:
        resumed.close()
