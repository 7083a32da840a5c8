"""LoRA in the learner, one process on CPU: only the adapter is trainable and held by AdamW; version 0 is the
base model (B = 0); a training step moves the adapter alone; the KL loss's reference is the base model
(the adapter disabled) after the adapter has trained, without a second copy; a lean start's name mapping
and seeded factors give what `inject` gives; checkpoints hold the adapter and AdamW state alone and refuse
a full-weight learner (and the other way round); the memory and host plans count the adapter, not the
base, for gradients, AdamW state, checkpoints and the reference; the config refusals."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig

from offpolicy.learner.batch import collate
from offpolicy.learner.build import build_reference, build_trainables
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.lean import load_shards, lora_base_names, materialize, meta_model
from offpolicy.learner.errors import CheckpointMismatch
from offpolicy.learner.model import LogProbs, Precision, load_model, lora, make_tiny_model
from offpolicy.learner.model.reference import AdapterOff
from offpolicy.learner.persist.checkpoint import base_meta
from offpolicy.learner.persist.single import load_checkpoint, snapshot_checkpoint, write_checkpoint
from offpolicy.learner.plan.host import host_plan
from offpolicy.learner.plan.memory import ModelShape, estimate
from offpolicy.learner.rl.microbatches import no_grad_logprobs
from tests.unit.learner.rl.test_microbatches import ragged_groups
from tests.unit.learner.test_memory_plan import QWEN_7B

CPU = torch.device("cpu")
FP32 = Precision.resolve("fp32", CPU)
RANK = 4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden_size=64, num_heads=1, num_layers=2, intermediate_size=96
    )


def lora_config(tiny, **kw) -> LearnerConfig:
    base = {
        "model_path": str(tiny), "device": "cpu", "lora": {"rank": RANK, "alpha": 8.0}, "seed": 3,
        "optimizer": {"lr": 1e-2},
    }  # fmt: skip
    return LearnerConfig.model_validate(base | kw)


@pytest.fixture
def batch():
    return collate(ragged_groups(3, 2, seed=5), pad_token_id=0)


def expected_adapter(hf) -> int:
    """rank x (in + out) over q, k, v, o, gate, up and down of every decoder layer (`all-linear`)."""
    h, i = hf.hidden_size, hf.intermediate_size
    head_dim = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    q, kv = hf.num_attention_heads * head_dim, hf.num_key_value_heads * head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return hf.num_hidden_layers * RANK * per_layer


def base_policy(tiny) -> torch.nn.Module:
    """The base model as the learner builds it (same attention kernel), full weights, no adapter."""
    parts, _, _ = build_trainables(LearnerConfig(model_path=str(tiny), device="cpu"), CPU, FP32, False, False)
    return parts.policy


def train_steps(parts, batch, steps: int) -> None:
    """`steps` plain optimizer steps on -sum(log-probs) of `batch` (no `Learner`)."""
    for _ in range(steps):
        lp, _ = parts.policy(batch, 64, True)
        (-lp.sum()).backward()
        torch.nn.utils.clip_grad_norm_([p for p in parts.policy.parameters() if p.requires_grad], 1.0)
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)


# --- trainable parameters and the optimizer


def test_only_the_adapter_is_trainable_held_by_adamw_and_published(tiny):
    cfg = lora_config(tiny, adv_estimator="gae")
    parts, publish_keys, way = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
    named = dict(parts.model.named_parameters())
    adapter = lora.adapter_names(parts.model)
    assert way == "whole" and adapter and publish_keys == set(adapter)
    assert all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert {n for n, p in named.items() if p.requires_grad} == set(adapter)
    in_adamw = {id(p) for g in parts.optimizer.param_groups for p in g["params"]}
    assert in_adamw == {id(named[n]) for n in adapter}
    count = sum(named[n].numel() for n in adapter)
    assert count == expected_adapter(AutoConfig.from_pretrained(tiny))
    assert {named[n].dtype for n in adapter} == {torch.float32}  # the masters' dtype, like the base
    # every targeted layer's base weight is there under peft's name, frozen
    assert sum(n.endswith(".base_layer.weight") for n in named) == len(LINEARS) * 2
    # the critic (GAE) has its own AdamW over all of its parameters
    assert parts.critic is not None and parts.critic_optimizer is not None
    critic = {id(p) for g in parts.critic_optimizer.param_groups for p in g["params"]}
    assert critic == {id(p) for p in parts.critic.parameters()} and not critic & in_adamw


def test_version_0_is_the_base_model_and_a_step_moves_the_adapter_alone(tiny, batch):
    parts, _, _ = build_trainables(lora_config(tiny), CPU, FP32, sharded=False, checkpointing=False)
    base = load_model(tiny, "cpu")
    want = base_policy(tiny)(batch, 64, True)[0]
    assert torch.equal(parts.policy(batch, 64, True)[0], want)  # B = 0: exactly the base model
    before = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    train_steps(parts, batch, 2)  # B moves at the first step; A (d/dA = 0 while B = 0) at the second
    for name, p in parts.model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == lora.is_adapter_name(name), name
        if not lora.is_adapter_name(name):
            assert torch.equal(p, base.state_dict()[lora.base_name(name)]), name
    assert not torch.equal(parts.policy(batch, 64, True)[0], want)


def test_under_bf16_mixed_the_frozen_base_is_bf16_and_the_adapter_keeps_fp32_masters(tiny, batch):
    mixed = Precision.resolve("bf16_mixed", CPU)
    cfg = lora_config(tiny, precision="bf16_mixed")
    parts, _, _ = build_trainables(cfg, CPU, mixed, sharded=False, checkpointing=False)
    dtypes = {n: p.dtype for n, p in parts.model.named_parameters()}
    assert {dtypes[n] for n in lora.adapter_names(parts.model)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not lora.is_adapter_name(n)} == {torch.bfloat16}  # no masters
    base = load_model(tiny, "cpu", torch.bfloat16).state_dict()
    with mixed.autocast():
        train_steps(parts, batch, 2)
    for name, t in parts.model.state_dict().items():  # the base untouched (bf16 as read), the adapter moved
        if lora.is_adapter_name(name):
            assert ".lora_A." in name or t.abs().sum() > 0, name
        else:
            assert torch.equal(t, base[lora.base_name(name)]), name
    assert all(s["exp_avg"].dtype == torch.float32 for s in parts.optimizer.state.values())


def test_the_reference_is_the_base_model_with_the_adapter_disabled(tiny, batch):
    cfg = lora_config(tiny, kl_loss_coef=0.1)
    parts, _, _ = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
    reference = build_reference(cfg, CPU, FP32, False, parts.policy)
    assert isinstance(reference, AdapterOff) and list(reference.parameters()) == []  # no second copy
    train_steps(parts, batch, 3)
    base = base_policy(tiny)(batch, 64, True)[0]
    ref = no_grad_logprobs(reference, batch, cfg.model_copy(update={"no_grad_micro_batch_tokens": 64}), FP32)
    policy = parts.policy(batch, 64, True)[0]
    assert not ref.requires_grad
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-6)
    assert float((policy - base).detach().abs().max()) > 1e-2  # the adapter has trained: the test has teeth
    # the adapter is back on, still trainable, after the reference's pass
    assert torch.equal(parts.policy(batch, 64, True)[0], policy)
    assert {n for n, p in parts.model.named_parameters() if p.requires_grad} == set(
        lora.adapter_names(parts.model)
    )
    # a reference model named in the config is loaded as before (a frozen `LogProbs` of its own)
    other = lora_config(tiny, kl_loss_coef=0.1, reference={"model_path": str(tiny)})
    assert isinstance(build_reference(other, CPU, FP32, False, parts.policy), LogProbs)


def test_modules_to_save_are_trained_and_disabled_with_the_adapter(tiny, batch):
    cfg = lora_config(tiny, lora={"rank": RANK, "modules_to_save": ["lm_head"]}, kl_loss_coef=0.1)
    parts, publish_keys, _ = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
    assert "lm_head.modules_to_save.default.weight" in publish_keys
    train_steps(parts, batch, 2)
    head = parts.model.lm_head
    assert not torch.equal(head.modules_to_save["default"].weight, head.original_module.weight)
    reference = build_reference(cfg, CPU, FP32, False, parts.policy)
    base = base_policy(tiny)(batch, 64, True)[0]
    torch.testing.assert_close(reference(batch, 64, True)[0], base, rtol=0, atol=1e-6)


def test_pi_old_never_drops_the_adapters_input(tiny, batch):
    cfg = lora_config(tiny, lora={"rank": RANK, "dropout": 0.5})
    parts, _, _ = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
    with torch.no_grad():  # B != 0, or dropout would change nothing
        for name, p in parts.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    run = cfg.model_copy(update={"no_grad_micro_batch_tokens": 64})
    a, b = (no_grad_logprobs(parts.policy, batch, run, FP32) for _ in range(2))
    assert torch.equal(a, b)
    with torch.no_grad():  # the training passes do drop
        assert not torch.equal(parts.policy(batch, 64, True)[0], parts.policy(batch, 64, True)[0])
    assert all(m.training for m in parts.policy.modules())  # back in train mode


# --- the lean start's names and factors


def test_a_lean_start_reads_the_base_under_its_names_and_draws_the_factors_inject_draws(tiny):
    cfg = lora_config(tiny, lora={"rank": RANK, "modules_to_save": ["lm_head"]}).lora
    whole = lora.inject(load_model(tiny, "cpu"), cfg, seed=3)
    lean = lora.inject(meta_model(tiny, torch.float32), cfg, seed=3)
    assert all(p.is_meta for p in lean.parameters())  # nothing drawn or read yet
    materialize(lean, CPU)
    assert load_shards(lean, tiny, lora_base_names)  # the base by its checkpoint names, the factors skipped
    for name, p in lean.named_parameters():
        if lora.is_factor(name):
            p.data.copy_(lora.initial_factor(name, p.shape, 3))
    want = whole.state_dict()
    for name, t in lean.state_dict().items():
        assert torch.equal(t, want[name]), name
    up = "model.layers.0.mlp.up_proj"
    assert lora.base_name(f"{up}.base_layer.weight") == f"{up}.weight"
    assert lora.base_name("lm_head.modules_to_save.default.weight") == "lm_head.weight"


def test_the_factors_are_drawn_from_the_seed_and_the_name_alone():
    a = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    b = "model.layers.1.self_attn.q_proj.lora_A.default.weight"
    first = lora.initial_factor(a, (4, 64), seed=1)
    assert torch.equal(first, lora.initial_factor(a, (4, 64), seed=1))
    assert not torch.equal(first, lora.initial_factor(b, (4, 64), seed=1))
    assert not torch.equal(first, lora.initial_factor(a, (4, 64), seed=2))
    assert float(first.abs().max()) <= 1 / math.sqrt(64) and float(first.std()) > 0.05  # Kaiming-uniform
    assert not lora.initial_factor(a.replace("lora_A", "lora_B"), (64, 4), seed=1).any()  # B zero


# --- checkpoints


def test_a_checkpoint_holds_the_adapter_and_adamw_state_alone_and_restores_them(tiny, batch, tmp_path):
    cfg = lora_config(tiny)
    parts, _, _ = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
    train_steps(parts, batch, 2)
    meta = base_meta(parts, version=2, step=1, run_id="r", config={}, buffer_position={})
    assert meta["lora"] is True
    path = write_checkpoint(tmp_path, snapshot_checkpoint(parts, meta))
    assert set(load_file(str(path / "model.safetensors"))) == set(lora.adapter_names(parts.model))
    full_cfg = LearnerConfig(model_path=str(tiny), device="cpu")
    full, _, _ = build_trainables(full_cfg, CPU, FP32, sharded=False, checkpointing=False)
    full_meta = base_meta(full, version=0, step=0, run_id="r", config={}, buffer_position={})
    full_path = write_checkpoint(tmp_path / "full", snapshot_checkpoint(full, full_meta))
    assert (path / "model.safetensors").stat().st_size * 5 < (full_path / "model.safetensors").stat().st_size

    resumed, _, _ = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
    load_checkpoint(path, resumed, "r")
    for (name, p), q in zip(parts.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    want, got = parts.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert want.keys() == got.keys() and want
    for i in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(want[i][key], got[i][key]), (i, key)
    # a LoRA checkpoint is not resumed by a full-weight learner, nor the other way round
    with pytest.raises(CheckpointMismatch, match=r"LoRA adapter.*full weights"):
        load_checkpoint(path, full, "r")
    with pytest.raises(CheckpointMismatch, match=r"full weights.*LoRA adapter"):
        load_checkpoint(full_path, resumed, "r")


# --- memory and host plans


def test_the_memory_plan_counts_gradients_and_adamw_state_for_the_adapter_alone(tiny):
    hf = AutoConfig.from_pretrained(tiny)
    cfg = lora_config(tiny, kl_loss_coef=0.1)
    parts, _, _ = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
    real = sum(p.numel() for p in parts.model.parameters() if p.requires_grad)
    shape = ModelShape.of(hf, cfg.lora)
    assert shape.adapter == real == expected_adapter(hf)  # exact: what AdamW holds
    full_cfg = LearnerConfig(model_path=str(tiny), device="cpu", kl_loss_coef=0.1)
    plan, full = (estimate(c, shape, 1, False, False, False) for c in (cfg, full_cfg))
    assert (plan.gradients, plan.optimizer) == (4 * real, 8 * real)  # fp32
    assert plan.weights == 4 * (shape.params + real) and full.weights == 4 * shape.params
    assert plan.reference == 0 and full.reference == 4 * shape.params  # no second copy under LoRA
    named = lora_config(tiny, kl_loss_coef=0.1, reference={"model_path": str(tiny)})
    assert estimate(named, shape, 1, False, False, False).reference == full.reference


def test_the_plans_of_a_7b_model_are_much_smaller_under_lora():
    lora_cfg = LearnerConfig(model_path="unused", lora={"rank": RANK}, kl_loss_coef=0.1)
    full_cfg = LearnerConfig(model_path="unused", kl_loss_coef=0.1)
    shape = ModelShape.of(QWEN_7B, lora_cfg.lora)
    assert shape.adapter == expected_adapter(QWEN_7B)  # q, k, v, o, gate, up, down of every layer
    plan, full = (estimate(c, shape, 8, True, True, True) for c in (lora_cfg, full_cfg))
    assert plan.gradients * 500 < full.gradients and plan.optimizer * 500 < full.optimizer
    assert plan.reference == 0 < full.reference
    assert plan.total < full.total - 3 * full.weights  # gradients, moments and the reference gone
    # host memory: the checkpoint stager, the publish snapshot and the offloaded state are the adapter's
    offload = {"fsdp": {"cpu_offload": True}, "checkpoint": {"checkpoint_dir": "/ckpt"}}
    host = host_plan(
        LearnerConfig.model_validate(lora_cfg.model_dump() | offload | {"reference": {"cpu_offload": True}}),
        shape.params, 8, True, True, adapter_params=shape.adapter,
    )  # fmt: skip
    whole = host_plan(
        LearnerConfig.model_validate(full_cfg.model_dump() | offload | {"reference": {"cpu_offload": True}}),
        shape.params, 8, True, True,
    )  # fmt: skip
    assert host.checkpoint_stager == 12 * shape.adapter // 8
    assert host.publish_snapshot * 500 < whole.publish_snapshot
    # the frozen base in bf16 (no masters) beside the adapter's fp32 masters, gradients and moments
    assert host.cpu_offload == (2 * shape.params + 16 * shape.adapter) // 8
    assert host.reference == 0 < whole.reference
    assert host.startup == (2 * shape.params + 4 * shape.adapter) // 8  # the base read in bf16
    assert plan.weights == (2 * shape.params + 4 * shape.adapter) // 8
    assert full.weights == 4 * shape.params // 8


def test_adapter_params_count_a_qwen_shaped_model_with_grouped_kv_heads():
    qwen = LlamaConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=500, tie_word_embeddings=False,
    )  # fmt: skip
    cfg = LearnerConfig(model_path="unused", lora={"rank": RANK, "target_modules": ["q_proj", "v_proj"]})
    assert ModelShape.of(qwen, cfg.lora).adapter == 3 * RANK * ((256 + 256) + (256 + 128))
    saved = LearnerConfig(model_path="unused", lora={"rank": RANK, "modules_to_save": ["lm_head"]})
    assert ModelShape.of(qwen, saved.lora).adapter == expected_adapter(qwen) + 500 * 256


# --- config


def test_lora_refuses_the_vllm_transport():
    with pytest.raises(ValidationError, match=r"publish\.transport: files"):
        LearnerConfig(model_path="m", lora={"rank": 8}, publish={"transport": "vllm"})
    assert LearnerConfig(model_path="m", lora={"rank": 8}).adapter_reference
    named = LearnerConfig(model_path="m", lora={"rank": 8}, reference={"model_path": "r"})
    assert not named.adapter_reference
    assert not LearnerConfig(model_path="m").adapter_reference


def test_a_vision_language_models_adapter_covers_its_language_model_alone(tmp_path) -> None:
    """On a vision-language model the adapter leaves the vision tower out (peft's `all-linear` would take
    its linear layers too, which vLLM does not serve): every factor is the language model's, the published
    config names no tower-only layer, and the memory plan counts the same adapter."""
    from offpolicy.learner.config.lora import LoraConfig
    from offpolicy.learner.model import make_tiny_vl_model

    path = make_tiny_vl_model(tmp_path / "vl")
    cfg = LoraConfig(rank=4, alpha=8.0)
    model = lora.inject(load_model(path, "cpu"), cfg, seed=0)
    factors = [n for n, p in model.named_parameters() if p.requires_grad]
    assert factors and all(n.startswith("model.language_model.") for n in factors), factors[:3]
    assert not any("visual" in n for n, p in model.named_parameters() if lora.is_adapter_name(n))
    assert not {"qkv", "proj"} & set(lora.adapter_config(cfg, model, str(path))["target_modules"])
    shape = ModelShape.of(AutoConfig.from_pretrained(path), cfg)
    assert shape.adapter == sum(p.numel() for p in model.parameters() if p.requires_grad)
