"""MoE policies: the router losses against transformers' own, the `moe` config section, what a coefficient
changes in the gradients, grouped-GEMM experts, LoRA on attention alone, dense models refused."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.lora import LoraConfig
from offpolicy.learner.config.moe import MoeConfig
from offpolicy.learner.model import load_model, lora, make_tiny_model, make_tiny_moe_model, moe
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.rl.update import policy_loss_terms

TINY_MOE = {"hidden_size": 64, "num_heads": 1, "num_layers": 2, "moe_intermediate_size": 32}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe") / "model", **TINY_MOE)


def groups(k: int = 2, n: int = 2, tokens: int = 6, seed: int = 0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    return [
        TrajectoryGroup(
            group_id=uuid.uuid4().hex,
            prompt_id=f"p{i}",
            prompt_ids=rng.integers(4, 101, 3 + i, dtype=np.int32),  # prompts of two widths: padding
            policy_version=0,
            actor_id="test",
            created_at=time.time(),
            sampling=SamplingParams(temperature=1.0, max_tokens=tokens),
            trajectories=[
                Trajectory(
                    response_ids=rng.integers(4, 101, tokens - j, dtype=np.int32),
                    behavior_logprobs=-(rng.random(tokens - j, dtype=np.float32) + 4.0),
                    reward=float(j),
                    finish_reason="length",
                )
                for j in range(n)
            ],
        )
        for i in range(k)
    ]


def test_router_losses_are_transformers_load_balancing_and_st_moe_z_loss():
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(10, 6, generator=gen) * 2 for _ in range(3))  # 3 layers, 10 tokens, 6 experts
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0  # padding
    aux, z = moe.router_losses(list(logits), 2, mask.reshape(-1))
    want = load_balancing_loss_func(logits, 6, 2, mask)
    assert aux.item() == pytest.approx(want.item(), rel=1e-6)
    real = mask.reshape(-1) > 0
    z_want = torch.cat([torch.logsumexp(x[real], -1) ** 2 for x in logits]).mean()
    assert z.item() == pytest.approx(z_want.item(), rel=1e-6)


def test_moe_section_validates_with_field_paths_and_defaults_to_verls_off():
    cfg = LearnerConfig(model_path="unused")
    assert cfg.moe == MoeConfig(aux_loss_coef=0.0, z_loss_coef=0.0) and not cfg.moe.on
    with pytest.raises(ValidationError) as err:
        LearnerConfig(model_path="unused", moe={"z_loss_coef": -1e-3})
    assert err.value.errors()[0]["loc"] == ("moe", "z_loss_coef")
    with pytest.raises(ValidationError) as err:
        LearnerConfig(model_path="unused", moe={"aux_coef": 0.1})  # a misspelt key is refused
    assert err.value.errors()[0]["loc"] == ("moe", "aux_coef")


def test_experts_run_grouped_mm_and_a_dense_policy_refuses_router_losses(moe_dir, tmp_path):
    model = load_model(moe_dir, CPU)
    assert moe.is_moe(model.config) and moe.num_experts(model.config) == 4
    assert moe.select_experts(model, CPU) == "grouped_mm"  # torch 2.13 has the CPU kernel
    router = moe.prepare(model, CPU, MoeConfig(aux_loss_coef=0.01), moe_dir)
    assert router is not None and len(router.routers) == 2  # one router per sparse layer
    dense = load_model(make_tiny_model(tmp_path / "dense", hidden_size=64, num_heads=1, num_layers=1), CPU)
    assert moe.prepare(dense, CPU, MoeConfig(), "dense") is None
    with pytest.raises(ValueError, match=r"moe\.aux_loss_coef=0\.01.*dense model"):
        moe.prepare(dense, CPU, MoeConfig(aux_loss_coef=0.01), "dense")


def router_grads(moe_dir, cfg: LearnerConfig, packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Gradient of one micro-batch's loss with respect to the first router's weight, and the terms."""
    torch.manual_seed(0)
    model = load_model(moe_dir, CPU)
    policy = LogProbs(model, router=moe.prepare(model, CPU, cfg.moe, moe_dir))
    batch = collate(groups(), pad_token_id=0)
    batch.old_log_probs = batch.behavior_logprobs
    batch.advantages = torch.linspace(-1, 1, batch.response_mask.numel()).view_as(batch.response_mask)
    log_prob, _ = policy(batch, 4096, packed)
    assert policy.router_losses is not None
    mask = batch.response_mask
    den = {"tokens": mask.sum(), "rows": (mask.sum(-1) > 0).sum(), "width": mask.shape[1]}
    den["seq_tokens"] = batch.attention_mask.sum()
    loss, _, terms = policy_loss_terms(log_prob, None, batch, cfg, den, policy.router_losses)
    loss.backward()
    return model.model.layers[0].mlp.gate.weight.grad.clone(), terms


@pytest.mark.parametrize("packed", [False, True])
def test_a_router_loss_coefficient_changes_the_router_gradients(moe_dir, packed):
    off, t_off = router_grads(moe_dir, LearnerConfig(model_path=str(moe_dir)), packed)
    aux, t_aux = router_grads(
        moe_dir, LearnerConfig(model_path=str(moe_dir), moe={"aux_loss_coef": 0.5}), packed
    )
    z, t_z = router_grads(moe_dir, LearnerConfig(model_path=str(moe_dir), moe={"z_loss_coef": 0.5}), packed)
    assert not torch.allclose(off, aux) and not torch.allclose(off, z) and not torch.allclose(aux, z)
    # the terms are reported whatever the coefficients, and are the same forward's
    assert t_off["moe/aux_loss"].item() == pytest.approx(t_aux["moe/aux_loss"].item(), rel=1e-5)
    assert 1.5 < t_off["moe/aux_loss"].item() < 2.5  # E sum f P: top_k = 2 for a near-uniform random router
    assert t_off["moe/z_loss"].item() > 0
    assert t_off["actor/pg_loss"].item() == pytest.approx(t_z["actor/pg_loss"].item(), rel=1e-6)


def test_no_router_losses_without_gradients(moe_dir):
    model = load_model(moe_dir, CPU)
    policy = LogProbs(model, router=moe.RouterLogits(model))
    with torch.no_grad():
        policy(collate(groups(), pad_token_id=0), 4096, True)
    assert policy.router_losses is None


def test_lora_on_an_moe_policy_takes_attention_alone(moe_dir):
    """peft's `all-linear` reaches the fused experts and the router of a transformers 5 MoE (its
    parameter wrappers); vLLM's LoRA is not known to serve those for every family: refused, by name."""
    model = load_model(moe_dir, CPU)
    lora.inject(model, LoraConfig(rank=4), seed=0)
    with pytest.raises(ValueError, match=r"lora\.target_modules: an MoE policy.*mlp\.experts"):
        moe.check_lora_targets(model)
    attention = load_model(moe_dir, CPU)
    lora.inject(
        attention, LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), seed=0
    )
    moe.check_lora_targets(attention)
    names = lora.adapter_names(attention)
    assert len(names) == 2 * 4 * 2 and all(".self_attn." in n for n in names)  # layers x projections x (A, B)


def test_a_running_dense_learner_refuses_router_losses_and_an_moe_one_takes_them(moe_dir):
    from types import SimpleNamespace

    from offpolicy.learner.errors import FrozenFieldChange
    from offpolicy.learner.reconfigure import ConfigSwitch

    old = LearnerConfig(model_path="m")
    new = LearnerConfig(model_path="m", moe={"z_loss_coef": 1e-3})
    metrics = SimpleNamespace(record_config=lambda *a: None)
    dense = ConfigSwitch(
        old, SimpleNamespace(), SimpleNamespace(policy=LogProbs(torch.nn.Linear(1, 1))), metrics, None
    )
    with pytest.raises(FrozenFieldChange) as err:
        dense.submit(new, 1)
    assert err.value.fields == ["moe.z_loss_coef"]
    model = load_model(moe_dir, CPU)
    sparse = SimpleNamespace(policy=LogProbs(model, router=moe.RouterLogits(model)))
    ConfigSwitch(old, SimpleNamespace(), sparse, metrics, None).submit(new, 1)  # queued for the next step
