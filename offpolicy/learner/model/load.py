"""Load any Hugging Face causal LM and its tokenizer for training; the dtype its checkpoint declares.

Nothing here knows the learner's ranks: sharding is learner/distributed/fsdp.py. `unique_state` is the state
dict the learner publishes and checkpoints (tied tensors once, as `save_pretrained` writes them).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import offpolicy.learner.model.attention  # noqa: F401  (registers `sdpa_varlen` with transformers)
from offpolicy.learner.model.vision import freeze_vision, is_vision_language


def load_model(
    path_or_id: str | Path,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    train_vision: bool = False,
) -> PreTrainedModel:
    """Load a causal LM by local path or hub id with parameters in `dtype` on `device`, in train mode. A
    vision-language checkpoint (Qwen2.5-VL) loads whole, its vision tower frozen (learner/model/vision.py)
    unless `train_vision` (the learner's `vision.train`).

    `dtype` is the master weights' dtype (`Precision.param_dtype`), not the checkpoint's: a bf16 release is
    upcast to fp32 masters under `bf16_mixed`; published weights are cast back to `checkpoint_dtype(path)`.
    `attn_implementation`: a kernel name of learner/model/attention.py (None = transformers' default).
    """
    config = AutoConfig.from_pretrained(str(path_or_id))
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    model = auto.from_pretrained(str(path_or_id), dtype=dtype, attn_implementation=attn_implementation)
    if is_vision_language(config) and not train_vision:
        freeze_vision(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device).train()


def checkpoint_dtype(path_or_id: str | Path) -> torch.dtype:
    """The dtype the model's checkpoint declares (`config.dtype`; float32 when it names none): the dtype
    published weights are written in. Read before loading, which overwrites `model.config.dtype`."""
    dtype = AutoConfig.from_pretrained(str(path_or_id)).dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A model folder's tokenizer is in at least one of these (Hugging Face's fast and slow layouts)."""


def missing_tokenizer(path_or_id: str | Path) -> str | None:
    """Why a local model folder gives no tokenizer (it holds none of `TOKENIZER_FILES`: weights copied without
    them), with the fix; None for a folder with one, or a hub id."""
    path = Path(path_or_id)
    if not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (
        f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the model's tokenizer files "
        f"into it, e.g. `huggingface-cli download <hub id> --include 'tokenizer*' 'vocab*' 'merges.txt' "
        f"--local-dir {path}`"
    )


def load_tokenizer(path_or_id: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer that goes with a model path or hub id; `FileNotFoundError` naming the files for a
    model folder without one (`missing_tokenizer`)."""
    why = missing_tokenizer(path_or_id)
    if why is not None:
        raise FileNotFoundError(why)
    return AutoTokenizer.from_pretrained(str(path_or_id))


def unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` without the second name of tied tensors (as `save_pretrained` drops them)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in module.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out
