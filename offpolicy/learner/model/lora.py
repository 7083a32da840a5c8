"""LoRA adapters on the policy (peft): injecting them, naming their tensors as peft and vLLM read them,
the `adapter_config.json` of a published adapter, and the base model with its adapter switched off.

Inside the learner the adapter's parameters are named as peft injects them into the model, e.g.
`model.layers.0.self_attn.q_proj.lora_A.default.weight`, and the frozen base weight of a targeted layer
`model.layers.0.self_attn.q_proj.base_layer.weight`. A published adapter (`adapter_model.safetensors`)
names them as `PeftModel.save_pretrained` does and vLLM's LoRA loader reads them:
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from offpolicy.weights.processor import is_vision_language

if TYPE_CHECKING:
    from offpolicy.learner.config.lora import LoraConfig

ADAPTER = "default"  # peft's adapter name: the one adapter a learner trains
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_ADAPTER_PART = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.default(?=\.|$)")
_SAVED_PART = re.compile(r"\.modules_to_save\.default(?=\.|$)")


def peft_config(cfg: LoraConfig, model: torch.nn.Module | None = None) -> Any:
    """peft's `LoraConfig` of our `lora` section (bias none, the causal-LM task) for `model` (a
    vision-language one: its vision tower left out)."""
    return cfg.peft(vision=is_vision_language(getattr(model, "config", None)))


def inject(
    model: torch.nn.Module, cfg: LoraConfig, seed: int, masters: torch.dtype | None = None
) -> torch.nn.Module:
    """Inject the adapter into `model` in place (A drawn from `seed`, the same on every rank; B zero:
    `initial_factor`) and freeze everything else; returns `model`. The adapter's tensors take the base
    layers' device (on the meta device for a lean start: learner/build.py fills them after sharding, from
    `initial_factor` too) and `masters`' dtype (None: the base layers'): a frozen base in bf16 beside
    fp32 adapter masters."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):  # peft's own draws are replaced below: the caller's RNG untouched
        inject_adapter_in_model(peft_config(cfg, model), model, adapter_name=ADAPTER)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(is_adapter_name(name))
            if p.requires_grad and masters is not None and p.dtype != masters:
                p.data = p.data.to(masters)
            if is_factor(name) and not p.is_meta:
                p.copy_(initial_factor(name, p.shape, seed))
    return model


def is_factor(name: str) -> bool:
    """True for a LoRA factor (A or B): drawn at injection, absent from the base checkpoint (a
    `modules_to_save` copy starts from the base module's weights instead)."""
    return bool(_ADAPTER_PART.search(name))


def initial_factor(name: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """The value the factor `name` starts from, fp32 in host memory, as peft initialises it: A Kaiming-
    uniform (U(-1/sqrt(in), 1/sqrt(in))) and B zero, so version 0 is the base model (an embedding's A
    zero, its B standard normal). Drawn from a generator seeded by `seed` and the name alone: every
    process, and a lean start's ranks filling their own shards after sharding, get the same tensor
    whatever else they draw or in which order."""
    match = _ADAPTER_PART.search(name)
    if match is None:
        raise ValueError(f"{name} is not a LoRA factor")
    kind, out = match.group(1), torch.zeros(tuple(shape), dtype=torch.float32)
    if kind in ("lora_A", "lora_embedding_B"):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        if kind == "lora_A":  # as peft's `reset_lora_parameters`
            torch.nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=gen)
        else:
            out.normal_(generator=gen)
    return out


def is_adapter_name(name: str) -> bool:
    """True for a parameter the adapter trains (A, B, or a `modules_to_save` copy)."""
    return bool(_ADAPTER_PART.search(name) or _SAVED_PART.search(name))


def base_name(name: str) -> str:
    """The base checkpoint's name of a parameter of the injected model (`.base_layer.` dropped, a
    `modules_to_save` copy's original): what a lean start reads from the model's safetensors."""
    name = name.replace(".base_layer.", ".")
    name = _SAVED_PART.sub("", name)
    return name.replace(".original_module.", ".")


def published_name(name: str) -> str:
    """The name an adapter tensor has in a published `adapter_model.safetensors` (peft's and vLLM's):
    `base_model.model.` + the name without the adapter's name."""
    name = _ADAPTER_PART.sub(lambda m: f".{m.group(1)}", name)
    name = _SAVED_PART.sub("", name)
    return PEFT_PREFIX + name


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The names of the adapter's parameters in `model` (what a LoRA learner trains, checkpoints and
    publishes), in the model's order."""
    return [n for n, _ in model.named_parameters() if is_adapter_name(n)]


def adapter_config(cfg: LoraConfig, model: torch.nn.Module, base_model: str) -> dict[str, Any]:
    """The `adapter_config.json` of a published adapter: peft's own serialisation of the config, with the
    target modules resolved to the layer names the model really has (vLLM checks them against its model)
    and `base_model_name_or_path`."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    doc = peft_config(cfg, model).to_dict()
    layers = [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    targeted = sorted({n.rsplit(".", 1)[-1] for n in layers})
    doc.update(target_modules=targeted, base_model_name_or_path=str(base_model), inference_mode=True)
    for key, value in list(doc.items()):
        if isinstance(value, set):
            doc[key] = sorted(value)
    return doc


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside: every LoRA layer of `model` computes its base layer alone and every
    `modules_to_save` copy gives way to its original (the KL loss's reference without a second copy of the
    weights); re-enabled on exit, even on an error."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    # the flag alone that the layers' forward reads: peft's `enable_adapters` also flips requires_grad on the
    # adapter (FSDP2's sharded parameters on N ranks) and back, which a no-grad pass has no use for
    layers = [
        m
        for m in model.modules()
        if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)) and not m._disable_adapters
    ]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """The adapter's dropout off inside (`lora.dropout` applies to the training passes alone: pi_old and the
    reference never drop): its `lora_dropout` modules in eval mode, back in train mode on exit. A no-op
    without an adapter or without dropout."""
    drops = [
        m
        for name, m in model.named_modules()
        if m.training and isinstance(m, torch.nn.Dropout) and name.rsplit(".", 2)[-2:-1] == ["lora_dropout"]
    ]
    for m in drops:
        m.eval()
    try:
        yield
    finally:
        for m in drops:
            m.train()
