"""The tiny local models of the quickstart, tests and benchmarks: a random Llama (or a random Qwen3-MoE:
`make_tiny_moe_model`, or a random Qwen2.5-VL: `make_tiny_vl_model`) and a character tokenizer.

The tiny model is a random Llama (hidden 128, 2 layers, 2 heads of head_dim 64, the smallest head size the
vLLM CPU attention backend accepts) with a character-level tokenizer, saved with `save_pretrained` so that
transformers and vLLM both load it from disk. Nothing is downloaded. `sample_completions` is a slow plain
torch sampler for tests and toy runs without vLLM.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Printable ASCII without \r, \v and \f (newline and tab kept): 97 characters.
CHARACTERS = tuple(dict.fromkeys(string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")))
# Messages as `role: content` lines; tools (when given) as a first `system:` line; an assistant's tool calls
# after its content in the Hermes format (`<tool_call>{"name", "arguments"}</tool_call>`, vLLM's `hermes`
# tool parser reads them back).
CHAT_TEMPLATE = (
    "{% if tools %}system: tools {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is string else '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one id per character, no merges, decoded by concatenation."""
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    vocab_size: int | None = None,
    num_kv_heads: int | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random Llama and its character tokenizer to `out_dir`; return the folder.

    head_dim = hidden_size / num_heads must be 64 or 128 for vLLM's CPU attention backend. `vocab_size`
    (None = the tokenizer's 101) pads the embedding to a real model's vocabulary, and with the other sizes
    and `dtype` builds the benchmarks' Llama-shaped models; the tokenizer stays the character one.
    """
    head_dim = _head_dim(hidden_size, num_heads)
    return _write(
        out_dir, LlamaForCausalLM, LlamaConfig, seed, dtype,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
    )  # fmt: skip


def make_tiny_moe_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 64,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random Qwen3-MoE (every layer sparse: `num_experts` experts, top-`experts_per_token`
    routing with the top-k weights renormalised, head_dim 64 as vLLM's CPU backend needs) and the character
    tokenizer to `out_dir`; return the folder. `save_pretrained` writes the Hugging Face checkpoint layout
    (one tensor per expert and projection), which transformers and vLLM both load."""
    head_dim = _head_dim(hidden_size, num_heads)
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(f"experts_per_token={experts_per_token} must lie in [1, num_experts={num_experts}]")
    return _write(
        out_dir, Qwen3MoeForCausalLM, Qwen3MoeConfig, seed, dtype,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,  # the dense MLP of `mlp_only_layers` (none here)
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=max_position_embeddings,
    )  # fmt: skip


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The Qwen2-VL family's image and video tokens, added to the character tokenizer of the tiny VL model."""
# CHAT_TEMPLATE with OpenAI content parts: an image part becomes `<|vision_start|><|image_pad|><|vision_end|>`
# (the processor widens the pad to the image's tokens), a text part its text.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tiny_vl_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    vision_hidden_size: int = 64,
    vision_depth: int = 2,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    vision_heads: int | None = None,
    vision_intermediate_size: int | None = None,
    vocab_size: int | None = None,
    min_pixels: int = 56 * 56,
    max_pixels: int = 112 * 112,
    seed: int = 0,
    dtype: str = "float32",
    family: Literal["qwen2_5_vl", "qwen3_vl"] = "qwen2_5_vl",
) -> Path:
    """Write a tiny random Qwen2.5-VL (a 2-block vision tower of patch 14 merging 2x2 patches into one
    token, window attention in its first block; a Llama-sized text model with 3-row rotary positions, head
    dim 64), the character tokenizer with the vision tokens, and Qwen2-VL's image processor (pixel budget
    `min_pixels`..`max_pixels`: a 56x56 image is 4 tokens) to `out_dir`; return the folder. transformers and
    vLLM both load it (on a machine without torchvision: weights/processor.py). The other sizes build the
    benchmarks' shapes (a Qwen2.5-VL-7B-shaped one: benchmarks/vision.py `--gpu`); `vocab_size` pads the
    embedding past the character tokenizer's. `family="qwen3_vl"`: a Qwen3-VL instead (patch 16, learned
    position embeddings, the first block's deepstack features added to the decoder's first layer, Qwen3
    text layers with interleaved 3-row rotary positions; a 64x64 image is 4 tokens)."""
    head_dim = _head_dim(hidden_size, num_heads)
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    from offpolicy.weights.processor import image_processor_class, images_without_torchvision

    images_without_torchvision()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    unit = head_dim // 16  # 3-row rotary sections (time, height, width): 2:3:3 of head_dim / 2 frequencies
    text = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads or num_heads,
        "max_position_embeddings": 2048,
        "vocab_size": vocab_size or len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2 * unit, 3 * unit, 3 * unit],
        },
    }
    vision = {
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": vision_intermediate_size or 2 * vision_hidden_size,
        "num_heads": vision_heads or max(1, vision_hidden_size // 64),
        "out_hidden_size": hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [vision_depth - 1],
    }
    patch = 14
    if family == "qwen3_vl":
        patch = 16
        text["head_dim"] = head_dim
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = {
            **{k: vision[k] for k in ("depth", "hidden_size", "intermediate_size", "num_heads")},
            "out_hidden_size": hidden_size, "patch_size": patch, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
        }  # fmt: skip
        if min_pixels == 56 * 56 and max_pixels == 112 * 112:  # the defaults: the same tokens per image
            min_pixels, max_pixels = 64 * 64, 128 * 128
    config_class, model_class = (
        (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
        if family == "qwen3_vl"
        else (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)
    )
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    image_processor_class()(
        patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=min_pixels, max_pixels=max_pixels
    ).save_pretrained(out)
    return out


def _head_dim(hidden_size: int, num_heads: int) -> int:
    head_dim = hidden_size // num_heads
    if head_dim not in (64, 128):
        raise ValueError(f"head_dim = hidden_size / num_heads = {head_dim}; vLLM on CPU needs 64 or 128")
    return head_dim


def _write(
    out_dir: str | Path, model_class: type, config_class: type, seed: int, dtype: str, **fields
) -> Path:
    """A random `model_class` of `config_class(**fields)` with the character tokenizer's ids (vocabulary:
    the tokenizer's unless `fields` pads it), untied embeddings, saved with the tokenizer to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = config_class(
        **{**fields, "vocab_size": fields.get("vocab_size") or len(tokenizer)},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def sample_completions(
    model: PreTrainedModel,
    prompt_ids: list[int],
    n: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], list[float]]]:
    """Sample `n` completions of one prompt with plain torch: [(token ids, log-probs at temperature)].

    A slow reference sampler (no KV cache) for tests, benchmarks and toy runs without vLLM. The log-probs
    are those of the distribution sampled from (logits / temperature), as vLLM's processed_logprobs.
    """
    device = next(model.parameters()).device
    seqs = torch.tensor([prompt_ids] * n, dtype=torch.long, device=device)  # (n, P)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    out_ids, out_logprobs = [], []
    for _ in range(max_new_tokens):
        logits = model(input_ids=seqs, logits_to_keep=1, use_cache=False).logits[:, -1].float()  # (n, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator)  # (n, 1)
        out_ids.append(tok[:, 0])
        out_logprobs.append(logp.gather(-1, tok)[:, 0])
        seqs = torch.cat([seqs, tok], dim=1)
        done |= tok[:, 0] == eos_token_id if eos_token_id is not None else done
        if bool(done.all()):
            break
    ids = torch.stack(out_ids, 1).tolist()  # (n, L)
    behavior_logprobs = torch.stack(out_logprobs, 1).tolist()  # (n, L): the sampler's, behaviour log-probs
    results = []
    for row_ids, row_logprobs in zip(ids, behavior_logprobs, strict=True):
        end = row_ids.index(eos_token_id) + 1 if eos_token_id in row_ids else len(row_ids)
        results.append((row_ids[:end], row_logprobs[:end]))
    return results
