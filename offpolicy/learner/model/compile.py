"""`torch.compile` of the decoder layers (`compile_layers`), torchtitan's way: each layer's forward compiled
on its own (one graph, reused by every layer of the same shape), not the whole model, so that

- FSDP2's pre- and post-forward hooks (the all-gather, the reshard) run outside the graph, in the module's
  `__call__`, and activation checkpointing (transformers' `GradientCheckpointingLayer.__call__`) wraps the
  compiled forward as it wraps the eager one;
- the shapes are dynamic (`dynamic=True`): a packed micro-batch's token count and its sequences' bounds
  differ from one micro-batch to the next, and a graph per length would recompile every step.

The LM head is not compiled here (model/head.py compiles its own fused log-prob function on CUDA).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def compile_layers(layers: nn.ModuleList) -> int:
    """Compile each layer's forward in place (before sharding or after: the hooks stay outside); the
    number compiled."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    log.info("compile_layers: %d decoder layers compiled (dynamic shapes)", len(layers))
    return len(layers)
