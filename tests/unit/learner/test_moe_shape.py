"""Mixture-of-experts shapes: the config.json reader (learner/plan/shape.py) gives the published total and
active parameters of Qwen3-30B-A3B and DeepSeek-V3 and the same total as transformers builds for each MoE
family; the memory plan counts the experts' state per rank, their gathered layer under `ep` and the routed
activations, and Qwen3-30B-A3B fits 8 x 80 GiB with the shipped learner config."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from offpolicy.learner.config import LearnerConfig, load_config
from offpolicy.learner.plan.memory import GIB, HEADROOM, ModelShape, estimate, expert_state
from offpolicy.learner.plan.shape import count

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "deploy" / "models"
TINY = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}


def published(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("deepseek-v3", 671e9, 37e9)],
)
def test_the_reader_gives_the_published_total_and_active_parameters(name, total, active):
    counts = count(published(name))
    assert counts.total == pytest.approx(total, rel=0.02)
    assert counts.active == pytest.approx(active, rel=0.02)
    assert counts.active_matmul < counts.active < counts.total  # no input embedding, no norm in MFU's
    assert counts.experts > 0.9 * counts.total  # the routed experts are nearly all of either model


TINY_MOES = {
    "qwen3_moe, every other layer sparse, one MLP-only": Qwen3MoeConfig(
        **TINY, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=24, intermediate_size=80, decoder_sparse_step=2, mlp_only_layers=[3],
    ),
    "qwen2_moe with a shared expert": Qwen2MoeConfig(
        **TINY, num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=40, intermediate_size=96,
    ),
    "mixtral": MixtralConfig(
        **TINY, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=96,
    ),
    "deepseek_v3, MLA, dense first layer": DeepseekV3Config(
        **TINY, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2,
        topk_group=1,
    ),
    "deepseek_v2, no q LoRA": DeepseekV2Config(
        **TINY, num_hidden_layers=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_group=1, topk_group=1,
    ),
}  # fmt: skip


def meta_params(hf: PretrainedConfig) -> tuple[int, int]:
    """(all parameters, the routed experts') of the model transformers builds, on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    named = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n and "shared" not in n)
    return sum(p.numel() for p in named.values()), experts


@pytest.mark.parametrize("hf", TINY_MOES.values(), ids=TINY_MOES.keys())
def test_the_reader_counts_what_transformers_builds(hf):
    counts = count(hf.to_dict())
    total, experts = meta_params(hf)
    assert (counts.total, counts.experts) == (total, experts)
    moe = counts.moe
    assert moe is not None and counts.active == total - experts + experts * moe.top_k // moe.routed


def test_a_dense_config_has_no_experts_and_is_all_active():
    hf = LlamaConfig(**TINY, num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=False)
    counts = count(hf.to_dict())
    assert counts.moe is None and counts.experts == 0
    assert counts.total == counts.active == meta_params(hf)[0]
    assert ModelShape.of(hf).active_params == ModelShape.of(hf).params


@pytest.fixture(scope="module")
def qwen3_30b() -> ModelShape:
    return ModelShape.of(AutoConfig.from_pretrained(MODELS / "qwen3-30b-a3b", local_files_only=True))


def test_the_shape_of_qwen3_30b_a3b_knows_its_experts(qwen3_30b):
    assert qwen3_30b.moe is not None and qwen3_30b.moe.routed == 128 and qwen3_30b.moe.top_k == 8
    assert qwen3_30b.expert_params == 48 * 128 * 3 * 2048 * 768
    assert qwen3_30b.params == count(published("qwen3-30b-a3b")).total  # the meta count agrees
    assert qwen3_30b.active_params == pytest.approx(3.3e9, rel=0.02)


def test_the_experts_state_is_sharded_over_the_ranks_and_in_the_plan(qwen3_30b):
    cfg = LearnerConfig(model_path="unused")
    state = expert_state(cfg, qwen3_30b, 8, True, cuda=True)
    eighth = qwen3_30b.expert_params // 8
    assert state == {"weights": 4 * eighth, "gradients": 4 * eighth, "optimizer": 8 * eighth}
    plan = estimate(cfg, qwen3_30b, 8, True, True, True)
    assert plan.weights >= state["weights"] and plan.optimizer >= state["optimizer"]
    lora = expert_state(LearnerConfig(model_path="unused", lora={"rank": 8}), qwen3_30b, 8, True, True)
    assert lora == {"weights": qwen3_30b.expert_params * 2 // 8, "gradients": 0, "optimizer": 0}


def test_expert_parallelism_gathers_an_ep_th_of_each_layers_experts(qwen3_30b):
    cfg = LearnerConfig(model_path="unused")
    fsdp = estimate(cfg, qwen3_30b, 8, True, True, True)
    ep8 = estimate(cfg, qwen3_30b, 8, True, True, True, ep=8)
    per_layer = qwen3_30b.expert_params // 48
    # two gathered layers in bf16, each with 1/8 of its experts in place of all of them
    assert fsdp.compute_copies - ep8.compute_copies == pytest.approx(2 * 2 * per_layer * 7 / 8, rel=1e-6)
    assert (ep8.weights, ep8.optimizer, ep8.activations) == (fsdp.weights, fsdp.optimizer, fsdp.activations)
    with pytest.raises(ValueError, match="ep 3"):
        estimate(cfg, qwen3_30b, 8, True, True, True, ep=3)


def test_the_routed_activations_grow_with_top_k(qwen3_30b):
    """Each routed expert a token goes to keeps its MLP's tensors (8 B per unit of width in bf16) and the
    token's copies into and out of it (2 x 2 B x hidden), in every MoE layer."""
    cfg = LearnerConfig(model_path="unused", micro_batch_tokens=4096, compile_layers=False)
    more = replace(qwen3_30b, moe=replace(qwen3_30b.moe, top_k=qwen3_30b.moe.top_k + 1))
    base = estimate(cfg, qwen3_30b, 8, True, False, True)
    wider = estimate(cfg, more, 8, True, False, True)
    per_token_layer = 8 * qwen3_30b.moe.width + 2 * 2 * qwen3_30b.hidden
    assert wider.activations - base.activations == 4096 * 48 * per_token_layer
    dense_like = replace(qwen3_30b, moe=None, intermediate=qwen3_30b.moe.width)
    assert base.activations > estimate(cfg, dense_like, 8, True, False, True).activations * 2


def test_qwen3_30b_a3b_fits_eight_80_gib_gpus_with_the_shipped_config(qwen3_30b):
    cfg = load_config(ROOT / "configs" / "learner.yaml", {})
    plan = estimate(cfg, qwen3_30b, 8, True, True, True)
    assert plan.total <= HEADROOM * 80 * GIB < estimate(cfg, qwen3_30b, 1, False, True, True).total


def test_deepseek_moe_layer_freq_and_first_dense_layers_pick_the_moe_layers():
    config = published("deepseek-v3") | {
        "num_hidden_layers": 10,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 2,
    }
    moe = count(config).moe
    assert moe is not None and moe.moe_layers == 4  # layers 2, 4, 6 and 8 (0: dense, first_k_dense_replace)
