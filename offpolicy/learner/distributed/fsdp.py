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

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from offpolicy.learner.distributed import expert_parallel as expert_parallel_

if TYPE_CHECKING:
    from offpolicy.learner.distributed.ranks import Ranks
    from offpolicy.learner.model.precision import Precision

log = logging.getLogger(__name__)


VISION_TOWERS = ("visual", "vision_tower", "vision_model")
"""Where vision-language models keep their vision tower (Qwen2-VL family: `model.visual`; LLaVA-style:
`vision_tower`): its blocks are not the decoder's layers."""


def decoder_layers(module: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder's layer list: the first `ModuleList` with `num_layers` entries outside a vision tower
    (Llama, Qwen, Mistral, Gemma, GPT-2, Qwen2.5-VL's language model ... all keep their blocks in one)."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) == num_layers and not _in_vision_tower(name):
            return sub
    raise ValueError(f"no ModuleList of {num_layers} decoder layers in {type(module).__name__}")


def vision_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of a vision-language model's vision tower (its first `ModuleList` inside one), else []."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and _in_vision_tower(name):
            return list(sub)
    return []


def num_decoder_layers(model: nn.Module) -> int:
    """The decoder's layer count (a vision-language model's: its language model's)."""
    return model.config.get_text_config().num_hidden_layers


def _in_vision_tower(name: str) -> bool:
    return any(part in VISION_TOWERS for part in name.split("."))


def fsdp_mesh(replicate: int, device: torch.device) -> DeviceMesh | None:
    """The ranks' mesh: None = one flat mesh over every rank (FSDP2's default); `replicate` > 1 = a 2-D
    mesh (`replicate` groups x world / `replicate` ranks): parameters sharded within a group (its ranks
    consecutive: a node's GPUs with `replicate` = nodes), replicated across the groups (HSDP: gradients
    reduce-scattered within a group, then all-reduced across groups). One mesh per process, reused."""
    if replicate == 1:
        return None
    world = dist.get_world_size()
    if world % replicate:
        raise ValueError(
            f"fsdp.replicate = {replicate} does not divide the {world} ranks: replica groups must be equal "
            "(e.g. the number of nodes)"
        )
    key = (replicate, device.type)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(
            device.type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
        )
        log.info("hybrid sharding: %d replica groups of %d ranks", replicate, world // replicate)
    return _MESHES[key]


_MESHES: dict[tuple[int, str], DeviceMesh] = {}


def shard(
    root: nn.Module,
    num_layers: int,
    precision: Precision,
    cpu_offload: bool,
    mesh: DeviceMesh | None = None,
    expert_parallel: int = 1,
) -> nn.Module:
    """`fully_shard` each decoder layer of `root` (and each block of a vision tower), then `root` itself (in
    place; returned), over `mesh`
    (`fsdp_mesh`; None = every rank, one dimension). `expert_parallel` > 1: a MoE model's experts are
    first cut over ep groups of that many ranks and sharded over the rest (distributed/expert_parallel.py;
    checked there: `fsdp.expert_parallel` must divide the ranks and the experts)."""
    kwargs: dict = {} if mesh is None else {"mesh": mesh}
    if precision.compute_dtype is not None:  # bf16_mixed: bf16 compute copies, fp32 masters and reduction
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=precision.compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if expert_parallel > 1:
        modules = expert_parallel_.experts_modules(root)
        expert_parallel_.check(
            expert_parallel, dist.get_world_size(), modules[0].num_experts if modules else 0,
            replicate=1 if mesh is None else mesh.size(0), cpu_offload=cpu_offload,
        )  # fmt: skip
        expert_kwargs = {k: v for k, v in kwargs.items() if k != "mesh"}  # the experts' mesh is their own
        expert_parallel_.shard_experts(root, expert_parallel, expert_parallel_.rank_device(), expert_kwargs)
    for layer in [*vision_blocks(root), *decoder_layers(root, num_layers)]:
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return root


def gradient_sync(modules: list[nn.Module | None], mode: str, last: bool) -> None:
    """Before a micro-batch's backward: whether its gradients are reduced now. `mini_batch`: only at the
    last micro-batch of the optimizer step (reduce-scatter and, with HSDP, the all-reduce across replica
    groups: one reduction per optimizer step); `micro_batch`: reduce-scatter every micro-batch, the
    all-reduce across replica groups at the last only. A module that is not FSDP-sharded (one process)
    is left as it is."""
    for module in modules:
        if isinstance(module, FSDPModule):
            if mode == "mini_batch":
                module.set_requires_gradient_sync(last)
            else:
                module.set_requires_gradient_sync(True)
                module.set_requires_all_reduce(last)


def loss_scale(ranks: Ranks) -> float:
    """Multiply each rank's loss by this: FSDP2's gradient average becomes the global loss's gradient."""
    return float(ranks.world_size)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` by the total norm over every rank's shards; returns that norm (a plain tensor).
    The gradients are normed per device mesh (expert parallelism's experts live on a mesh of their own)."""
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # reduced across the ranks
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
