"""Activation checkpointing of k of a model's L decoder layers (torchtitan's per-layer selective
checkpointing): the chosen layers keep only their input and recompute their forward in the backward pass,
the others keep their saved tensors. k comes from `gradient_checkpointing` / `checkpoint_layers` or the
memory plan (learner/plan/auto.py); k = L is transformers' whole-model checkpointing.

The k layers are spread evenly through the stack (`evenly(k, L)`): the memory is the same whichever are
chosen, and an even spread keeps each FSDP2 unit's backward (one layer each) as uniform as the choice
allows. transformers' `GradientCheckpointingLayer.__call__` checkpoints a layer when its
`gradient_checkpointing` flag is set and it is training: `gradient_checkpointing_enable` sets the flag on
every layer (non-reentrant `torch.utils.checkpoint`, which composes with FSDP2's hooks and
`torch.compile`), then it is cleared on the L - k layers that keep their activations. Without grad (the
pi_old pass) nothing is checkpointed or saved either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from transformers import PreTrainedModel


def evenly(k: int, layers: int) -> list[int]:
    """k of `layers` indices spread evenly (the i-th is where the running share k * (i + 1) / layers
    crosses an integer): k = layers gives all of them, 0 none."""
    return [i for i in range(layers) if (i + 1) * k // layers > i * k // layers]


def checkpoint_layers(model: PreTrainedModel, layers: Sequence[nn.Module], k: int) -> list[int]:
    """Checkpoint `k` (at most all) of `model`'s decoder `layers`, spread evenly; the indices checkpointed.
    k = 0 changes nothing; k = all is transformers' whole-model checkpointing."""
    chosen = evenly(min(k, len(layers)), len(layers))
    if not chosen:
        return []
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if len(chosen) == len(layers):
        return chosen
    keep = set(chosen)
    for i, layer in enumerate(layers):
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(
                f"{type(layer).__name__} is not a transformers GradientCheckpointingLayer: its layers cannot "
                "be checkpointed one by one; set checkpoint_layers to null (all layers) or "
                "gradient_checkpointing: false"
            )
        layer.gradient_checkpointing = i in keep
    return chosen
