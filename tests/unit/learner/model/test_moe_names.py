"""Published MoE weights under the checkpoint's names: the split equals what `save_pretrained` writes for
each family, `from_checkpoint` undoes it, vLLM's expert mapping accepts every expert name, and a published
version folder loads into a fresh transformers model with the learner's weights."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from offpolicy.learner.model import build_char_tokenizer, unique_state
from offpolicy.learner.model.moe_names import checkpoint_entries, from_checkpoint, to_checkpoint
from offpolicy.learner.persist.file_generation import publish_weights

SIZES = dict(
    vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
    num_key_value_heads=1, head_dim=64, num_experts_per_tok=2, tie_word_embeddings=False,
)  # fmt: skip


def family(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SIZES, num_experts=4, moe_intermediate_size=32))
    if name == "qwen2_moe":
        return Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                **SIZES, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32
            )
        )
    return MixtralForCausalLM(MixtralConfig(**SIZES, num_local_experts=4))


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_split_is_save_pretrained_and_from_checkpoint_undoes_it(name, tmp_path):
    model = family(name)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    state = unique_state(model)
    split = to_checkpoint(state, model.config)
    assert sorted(split) == sorted(saved)
    for key, t in saved.items():
        assert torch.equal(split[key], t), key
        assert split[key].is_contiguous(), key  # written as they are, no copy
    entries = [n for k, v in state.items() for n, _ in checkpoint_entries(k, tuple(v.shape), model.config)]
    assert entries == list(split)  # the streamed write's layout, before its tensors arrive
    back = from_checkpoint(split, model.config)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize(
    ("name", "gate", "down", "up"),
    [("qwen3_moe", "gate_proj", "down_proj", "up_proj"), ("mixtral", "w1", "w2", "w3")],
)
def test_every_expert_name_matches_vllms_expert_mapping(name, gate, down, up):
    """vLLM's `RoutedExperts.load_weights` takes a per-expert checkpoint tensor when exactly one entry of
    its expert mapping (`experts.{e}.{proj}.`) is in the name (the names its Qwen3-MoE and Mixtral
    models pass: `ckpt_gate_proj_name` etc.); no fused 3-D tensor is left."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    mapping = RoutedExperts.build_expert_params_mapping(
        gate, down, up, num_experts=4, routed_experts_prefix=""
    )
    model = family(name)
    split = to_checkpoint(unique_state(model), model.config)
    experts = [k for k in split if ".experts." in k]
    assert len(experts) == 2 * 4 * 3 and all(split[k].dim() <= 2 for k in split)
    for key in experts:
        hits = [(e, shard) for _, weight_name, e, shard in mapping if weight_name in key]
        assert len(hits) == 1, (key, hits)
        e, shard = hits[0]
        assert f".experts.{e}." in key and key.endswith({"w1": gate, "w2": down, "w3": up}[shard] + ".weight")


def test_a_published_moe_version_loads_into_transformers(tmp_path):
    model = family("qwen3_moe")
    record = publish_weights(model, tmp_path / "weights", 3, tokenizer=build_char_tokenizer())
    folder = tmp_path / "weights" / "v3"
    assert record.version == 3 and folder.is_dir()
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(loaded, Qwen3MoeForCausalLM)
    for (n, p), (m, q) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n == m and torch.equal(p, q), n
