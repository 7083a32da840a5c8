"""FSDP2 for the learner: shard the policy and the critic, scale the loss, clip sharded gradients.

The policy is sharded as `model.LogProbs` (the module the train loop calls for log-probs), so under FSDP2
the root's parameters (embeddings, final norm, LM head, tied or not) are all-gathered by the root's own
pre-forward hook. `shard` applies
`fully_shard` to every decoder layer, then to the root, over fp32 master weights sharded across the ranks,
with a `MixedPrecisionPolicy` (bf16 parameters for compute, fp32 gradient reduction) under `bf16_mixed`
and, optionally, `CPUOffloadPolicy` (parameters, gradients and optimizer state in host memory; the
optimizer steps on the CPU).

Gradients: FSDP2 averages them over the ranks; each rank's loss is its share of the global loss (global
denominators), so the loss is scaled by the world size (`loss_scale`) to make the reduced gradient the
gradient of the global loss (gloo has no pre-multiplied sum, so `set_gradient_divide_factor` is not used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from learner.distributed.ranks import Ranks
    from learner.model.precision import Precision


def decoder_layers(module: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder's layer list: the first `ModuleList` with `num_layers` entries (Llama, Qwen, Mistral,
    Gemma, GPT-2 ... all keep their blocks in one)."""
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) == num_layers:
            return sub
    raise ValueError(f"no ModuleList of {num_layers} decoder layers in {type(module).__name__}")


def shard(root: nn.Module, num_layers: int, precision: Precision, cpu_offload: bool) -> nn.Module:
    """`fully_shard` each decoder layer of `root`, then `root` itself (in place; returned)."""
    kwargs: dict = {}
    if precision.compute_dtype is not None:  # bf16_mixed: bf16 compute copies, fp32 masters and reduction
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=precision.compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(root, num_layers):
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return root


def loss_scale(ranks: Ranks) -> float:
    """Multiply each rank's loss by this: FSDP2's gradient average becomes the global loss's gradient."""
    return float(ranks.world_size)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` by the total norm over every rank's shards; returns that norm (a plain tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the shards' norms reduced across the ranks
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
