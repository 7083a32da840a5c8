"""FSDP2 for the learner: shard the policy and the critic, clip sharded gradients, gather full weights.

`LogProbs` is the module the train loop calls for log-probs (one process or N): its forward runs the
decoder and the chunked LM head (learner/batching.py), so under FSDP2 the root's parameters (embeddings,
final norm, LM head, tied or not) are all-gathered by the root's own pre-forward hook. `shard` applies
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from learner.batching import Batch, token_logprobs

if TYPE_CHECKING:
    from learner.distributed import Ranks
    from learner.precision import Precision


class LogProbs(nn.Module):
    """`forward(batch, chunk_tokens)` = `token_logprobs(lm, batch, chunk_tokens)`: (B, R)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, batch: Batch, chunk_tokens: int) -> torch.Tensor:
        return token_logprobs(self.lm, batch, chunk_tokens)


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


def full_state(module: nn.Module, keys: set[str]) -> dict[str, torch.Tensor]:
    """Every rank calls this (a collective): the full, unsharded tensors of `module` named in `keys`, in
    rank 0's host memory (empty elsewhere)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v for k, v in get_model_state_dict(module, options=opts).items() if k in keys}
