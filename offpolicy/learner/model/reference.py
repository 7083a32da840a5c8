"""The frozen scorers: the reference policy of the KL loss and the teacher of on-policy distillation, each
loaded once, never trained, optionally kept in host memory (one machinery, two roles: learner/build.py
`build_frozen`).

A frozen scorer is a `LogProbs` like the policy (the same log-probs at each row's temperature, packed or
padded), with every parameter frozen and in eval mode; the learner calls it under no_grad once per step on
the same micro-batches as pi_old. Under LoRA the reference is by default the policy itself with its adapter
disabled (`AdapterOff`): the base model, never loaded twice. On N ranks it is sharded like the policy
(learner/build.py). On one CUDA process `stream_layers` keeps its decoder layers in pinned host memory and
copies each to the GPU for its own forward: one layer of weights on the GPU at a time, plus the
embeddings, final norm and LM head.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from offpolicy.learner.errors import TokenizerMismatch
from offpolicy.learner.model import lora
from offpolicy.learner.model.load import load_tokenizer
from offpolicy.weights.host_buffers import host_set

if TYPE_CHECKING:
    from offpolicy.learner.batch import Batch
    from offpolicy.learner.config import LearnerConfig


def freeze(module: nn.Module) -> nn.Module:
    """No gradients, eval mode (no dropout): a reference that never changes."""
    module.requires_grad_(False)
    return module.eval()


class AdapterOff(nn.Module):
    """The KL loss's reference under LoRA without `reference.model_path`: the policy's own `LogProbs` (on N
    ranks its FSDP2-sharded root, whose hooks gather the shards) run under no_grad with its adapter disabled
    (`lora.adapters_disabled`): the base model's log-probs with no second copy of the weights. Called as
    the policy is, `(batch, chunk_tokens, packed, entropy)` -> (log-probs, entropy or None). The policy is
    held outside this module's children, so that `freeze`, `eval` or `parameters()` on the reference never
    reach the policy's weights."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule (class docstring)

    def forward(
        self, batch: Batch, chunk_tokens: int, packed: bool = False, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad(), lora.adapters_disabled(self.policy):
            return self.policy(batch, chunk_tokens, packed, entropy)


def stream_layers(model: nn.Module, layers: Iterable[nn.Module], device: torch.device) -> None:
    """`model` (in host memory) on `device` except `layers`: those stay in host memory (on CUDA page-locked,
    one set of exactly their bytes per layer) and their parameters and buffers get device copies for the
    duration of each one's forward alone (forward hooks; for no_grad use: the device copies are dropped
    when the forward returns)."""
    streamed: set[int] = set()
    for layer in layers:
        tensors = [*layer.parameters(), *layer.buffers()]
        host = [t.data for t in tensors]
        if device.type == "cuda":  # weights/host_buffers.py: exact size
            pinned = host_set({str(i): (t.shape, t.dtype) for i, t in enumerate(host)}, pin=True)
            host = [pinned[str(i)].copy_(t) for i, t in enumerate(host)]
            layer._offpolicy_pinned = pinned  # the registration lives as long as the layer
        for t, h in zip(tensors, host, strict=True):
            t.data = h
        streamed |= {id(t) for t in tensors}

        def load(_module: nn.Module, _args: object, tensors=tensors, host=host) -> None:
            for t, h in zip(tensors, host, strict=True):
                t.data = h.to(device, non_blocking=True)

        def drop(_module: nn.Module, _args: object, _out: object, tensors=tensors, host=host) -> None:
            for t, h in zip(tensors, host, strict=True):
                t.data = h

        layer.register_forward_pre_hook(load)
        layer.register_forward_hook(drop)
    for t in (*model.parameters(), *model.buffers()):  # embeddings, final norm, LM head, rotary tables
        if id(t) not in streamed:
            t.data = t.data.to(device)


def tokenizer_differences(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> list[str]:
    """What differs between two tokenizers that must give the same ids to the same tokens (the policy's and
    the distillation teacher's): the vocabulary (size, then the first differing tokens) and the special
    tokens (their names and ids). Empty: they match."""
    out = []
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        some = ", ".join(f"{t!r}={i}" for t, i in diff)
        out.append(f"vocabulary ({len(a)} vs {len(b)} tokens; e.g. {some})")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        sa, sb = getattr(student, name), getattr(teacher, name)
        ia, ib = getattr(student, f"{name}_id"), getattr(teacher, f"{name}_id")
        if (sa, ia) != (sb, ib):
            out.append(f"{name} ({sa!r}={ia} vs {sb!r}={ib})")
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens):
        out.append(f"special tokens ({student.all_special_tokens} vs {teacher.all_special_tokens})")
    return out


def check_teacher_tokenizer(config: LearnerConfig) -> None:
    """Refuse a distillation teacher whose tokenizer is not the policy's (`TokenizerMismatch`, naming both
    models and what differs): its log-probs of the sampled ids would score other tokens."""
    teacher = config.teacher.model_path
    if teacher is None:
        return
    diff = tokenizer_differences(load_tokenizer(config.model_path), load_tokenizer(teacher))
    if diff:
        raise TokenizerMismatch(
            f"teacher.model_path={str(teacher)!r} has another tokenizer than model_path="
            f"{str(config.model_path)!r}: {'; '.join(diff)}. On-policy distillation scores the student's "
            "token ids with the teacher: both must share the vocabulary and special tokens"
        )
