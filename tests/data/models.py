"""Model configs the memory plan reads, without their weights: `write_config(folder, QWEN_7B_CONFIG)` makes a
folder `AutoConfig.from_pretrained` reads (config.json only)."""

from __future__ import annotations

import json
from pathlib import Path

QWEN_7B_CONFIG = {  # Qwen/Qwen2.5-7B-Instruct's config.json, the fields the memory plan reads
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}


def write_config(folder: Path, config: dict) -> Path:
    """`folder` with `config` as its config.json (no weights, no tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
