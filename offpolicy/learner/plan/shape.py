"""The parameter counts of a model read from its config.json (a dict, no weight, no transformers): total,
active per token, and the routed experts' of a mixture-of-experts model.

Understood: dense decoders (Llama, Qwen2/3, Mistral), Qwen2-MoE and Qwen3-MoE (`num_experts`,
`num_experts_per_tok`, `moe_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers`, Qwen2-MoE's
`shared_expert_intermediate_size` and its one-logit shared-expert gate), Mixtral (`num_local_experts`,
`num_experts_per_tok`, `intermediate_size` the expert's width) and DeepSeek-V2/V3 (`n_routed_experts`,
`n_shared_experts`, `moe_intermediate_size`, `first_k_dense_replace`, `moe_layer_freq`, and multi-head
latent attention: `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`).
Every MLP and expert is gated (gate, up and down: 3 x hidden x width); the router is hidden x experts.

- `total`: every parameter, as transformers builds the model (tests/unit/learner/test_moe_shape.py holds it
  equal to a meta-device count on each family); DeepSeek-V3's multi-token-prediction layer is not counted
  (transformers does not build it; the published 671B leaves it out too).
- `active`: the parameters one token passes through: all but the routed experts it is not sent to
  (attention, dense MLPs, shared experts, top_k routed experts, the router, the norms, the input embedding
  and the LM head). The published "A3B" / "37B activated" figures count the same way.
- `experts`: the routed experts' parameters, all layers (what expert parallelism divides).
- `active_matmul`: what MFU multiplies by (prime-rl's `PerfCounter.get_active_mm_params`): the active
  linear layers' weights and the LM head; no norm, no bias, no input embedding (a lookup).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Experts:
    """The mixture-of-experts part of a model's shape (per MoE decoder layer unless said)."""

    routed: int  # routed experts per MoE layer
    top_k: int  # routed experts per token
    width: int  # an expert's MLP width (moe_intermediate_size; Mixtral: intermediate_size)
    moe_layers: int  # decoder layers with a MoE block (the others: a dense MLP of `dense_width`)
    shared_width: int = 0  # the shared experts' MLP width, all of them together (0: none)
    dense_width: int = 0  # the dense layers' MLP width (intermediate_size)

    def routed_params(self, hidden: int) -> int:
        """The routed experts' parameters of one MoE layer (gate, up, down of each)."""
        return self.routed * 3 * hidden * self.width

    @property
    def active_width(self) -> int:
        """The MLP width a token passes through in a MoE layer: top_k experts and the shared ones."""
        return self.top_k * self.width + self.shared_width


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """A model's parameters by the module docstring's conventions."""

    total: int
    active: int
    experts: int  # the routed experts', all layers
    active_matmul: int
    moe: Experts | None = None  # None: a dense model


def _get(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` that `config` sets to something other than None."""
    return next((config[n] for n in names if config.get(n) is not None), default)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (a VLM's `text_config`), else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def experts_of(config: Mapping[str, Any]) -> Experts | None:
    """The MoE part of a config.json dict (module docstring), None for a dense model."""
    c = text_config(config)
    layers, dense = c["num_hidden_layers"], c.get("intermediate_size") or 0
    if c.get("n_routed_experts"):  # DeepSeek-V2/V3
        first, freq = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
        moe = sum(1 for i in range(layers) if i >= first and i % freq == 0)
        width = c["moe_intermediate_size"]
        shared = (c.get("n_shared_experts") or 0) * width
        return Experts(c["n_routed_experts"], c["num_experts_per_tok"], width, moe, shared, dense)
    routed = _get(c, "num_experts", "num_local_experts", default=0)  # transformers 5 writes the latter
    if routed and c.get("moe_intermediate_size"):  # Qwen2-MoE, Qwen3-MoE
        step, only = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or ())
        moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
        shared = c.get("shared_expert_intermediate_size") or 0
        return Experts(routed, c["num_experts_per_tok"], c["moe_intermediate_size"], moe, shared, dense)
    if routed:  # Mixtral: every layer, intermediate_size is the expert's
        return Experts(routed, c["num_experts_per_tok"], dense, layers, 0, 0)
    return None


def attention_params(c: Mapping[str, Any]) -> tuple[int, int]:
    """(matmul weights, other parameters: norms, biases) of one decoder layer's attention."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3)
        rope, nope, v = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        q_rank, kv_rank = c.get("q_lora_rank"), c["kv_lora_rank"]
        q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        kv = h * (kv_rank + rope) + kv_rank * heads * (nope + v)
        return q + kv + heads * v * h, (q_rank or 0) + kv_rank
    head_dim = c.get("head_dim") or h // heads
    kv_heads = c.get("num_key_value_heads") or heads
    q, kv = heads * head_dim, kv_heads * head_dim
    qkv_bias = c.get("model_type") in ("qwen2", "qwen2_moe") or bool(c.get("attention_bias"))
    other = (q + 2 * kv) * qkv_bias + h * bool(c.get("attention_bias"))  # o_proj's bias
    if c.get("model_type") in ("qwen3", "qwen3_moe"):  # per-head RMSNorm of q and k
        other += 2 * head_dim
    return 2 * h * q + 2 * h * kv, other


def count(config: Mapping[str, Any]) -> ParamCounts:
    """The parameter counts of a config.json dict (module docstring)."""
    c = text_config(config)
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    attn, attn_other = attention_params(c)
    norms = 2 * h  # the input and post-attention RMSNorms
    moe = experts_of(c)
    tied = bool(c.get("tie_word_embeddings", False))
    embed = vocab * h
    dense_mlp = 3 * h * (c.get("intermediate_size") or 0)
    if moe is None:
        total_layers = layers * (attn + attn_other + norms + dense_mlp)
        total = total_layers + embed * (1 if tied else 2) + h
        return ParamCounts(total, total, 0, layers * (attn + dense_mlp) + embed)
    routed = moe.routed_params(h)
    router = moe.routed * h
    shared_gate = h if c.get("model_type") == "qwen2_moe" and moe.shared_width else 0
    moe_mlp_active = 3 * h * moe.active_width + router  # matmuls a token passes through
    dense_layers = layers - moe.moe_layers
    mlp_total = dense_layers * dense_mlp + moe.moe_layers * (
        routed + 3 * h * moe.shared_width + router + shared_gate
    )
    total = layers * (attn + attn_other + norms) + mlp_total + embed * (1 if tied else 2) + h
    experts = moe.moe_layers * routed
    inactive = moe.moe_layers * (moe.routed - moe.top_k) * 3 * h * moe.width
    matmul = (
        layers * attn + dense_layers * dense_mlp + moe.moe_layers * (moe_mlp_active + shared_gate) + embed
    )
    return ParamCounts(total, total - inactive, experts, matmul, moe)
