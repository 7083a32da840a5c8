"""FSDP2 for the learner: shard the policy and the critic, clip sharded gradients, gather full weights
to rank 0's host memory for publishing.

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


class GatheredWeights:
    """The full weights of a sharded module in rank 0's host memory, in the publish dtype (a collective:
    every rank constructs one; only the leader's holds tensors). Stands in for `weights.HostCopy`.

    Each shard is cast to `dtype` on its own rank before the all-gather (a bf16 publish of fp32 masters
    moves half the bytes), the tensors are gathered one at a time (one full tensor on a device at once), and
    the leader copies each into its host buffers (`into` reused when shape and dtype match; pinned on CUDA)
    on the compute stream without blocking. `wait()` returns once the last copy has landed.
    """

    def __init__(
        self,
        module: nn.Module,
        keys: set[str],
        dtype: torch.dtype,
        leader: bool,
        into: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._done: torch.cuda.Event | None = None
        for name, t in module.state_dict().items():  # the same names in the same order on every rank
            if name not in keys:
                continue
            full = _full_tensor(t.detach(), dtype if t.is_floating_point() else t.dtype)
            if not leader:
                continue
            buf = into.get(name) if into is not None else None
            if buf is None or buf.shape != full.shape or buf.dtype != full.dtype:
                buf = torch.empty(full.shape, dtype=full.dtype, pin_memory=full.is_cuda)
            buf.copy_(full, non_blocking=full.is_cuda)  # same stream: `full`'s memory is reused only after
            self.tensors[name] = buf
            if full.is_cuda and self._done is None:
                self._done = torch.cuda.Event()
        if self._done is not None:
            self._done.record()

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until every copy has landed; return the host tensors (the leader's; empty elsewhere)."""
        if self._done is not None:
            self._done.synchronize()
        return self.tensors


def _full_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` whole, in `dtype`: a DTensor's shards cast, then all-gathered; a plain tensor only cast."""
    if not isinstance(t, DTensor):
        return t.to(dtype)
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:  # CPU-offloaded shards: NCCL gathers device tensors
        local = local.to(t.device_mesh.device_type)
    cast = DTensor.from_local(
        local.to(dtype), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
    return cast.full_tensor()
