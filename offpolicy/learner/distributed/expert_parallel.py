"""Expert parallelism (EP) for a mixture-of-experts policy on N ranks, beside FSDP2.

The ranks form a 2-D mesh `(dp, ep)` of `N / ep` x `ep` ranks (`expert_mesh`; an ep group is `ep`
consecutive ranks: a node's GPUs when `ep` <= GPUs per node). Each sparse block's fused experts
(transformers 5: `experts.gate_up_proj` (E, 2I, H) and `experts.down_proj` (E, H, I)) are cut on the
expert dim over the ep group: ep rank j holds experts [j E/ep, (j+1) E/ep) (`Shard(0)` over `ep`), and
FSDP2 shards those again on the `dp` dimension (one `fully_shard` unit per experts module over `mesh["dp"]`:
FSDP's 2-D layout, `_StridedShard(0)` over dp then `Shard(0)` over ep). So every rank holds E / N of the
experts' weights, gradients and AdamW state (as the memory plan counts), FSDP gathers only a layer's
E / ep local experts for its compute, and every other parameter (attention, router, norms, embeddings)
is sharded by FSDP2 over all ranks as before.

The experts' forward (`ep_forward`, which replaces the module's) is the same math as one process's
grouped GEMMs: the (token, expert) pairs are sorted by expert, the counts exchanged, the rows sent with
`all_to_all_single_autograd` to the rank of their expert, computed there by the local experts as one
grouped computation (transformers' `_grouped_linear`: `grouped_mm` where it dispatches, its fallback
elsewhere), sent back, weighted by the router's top-k weights and summed over k in the original order.

Gradients: each rank's loss is scaled by N (fsdp.py `loss_scale`); an expert's local gradient sums the
scaled losses of its ep group's tokens, and FSDP2 averages it over the N / ep dp replicas, which leaves
ep x the global loss's gradient: the forward scales the experts' gradients by 1 / ep (`_GradScale`).

State dicts hold the experts as DTensors of the full shape under their own names, so DCP checkpoints
and the publish gather (`gather.GatheredWeights`: a layout other than FSDP's rows, so each expert tensor
is all-gathered whole, one at a time) see every expert in the original layout. The experts' FSDP units
follow `fsdp.grad_sync` like every other unit (this module adds no reduction of its own). Limits: not
with `fsdp.replicate` > 1 or `fsdp.cpu_offload`; the KL reference and the teacher are sharded by FSDP2
alone (every expert of a layer gathered for its compute).
"""

from __future__ import annotations

import logging
import types
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.distributed.ranks import Ranks

log = logging.getLogger(__name__)

FIELD = "fsdp.expert_parallel"


def check(ep: int, world: int, experts: int, *, replicate: int = 1, cpu_offload: bool = False) -> None:
    """Refuse an expert-parallel size that cannot work, naming `fsdp.expert_parallel` and the values: it
    must divide the `world` size and the model's routed `experts` (0 = a dense model: only ep = 1), and
    it does not combine with `fsdp.replicate` > 1 or `fsdp.cpu_offload`."""
    if ep < 1:
        raise ValueError(f"{FIELD} = {ep}: at least 1")
    if ep == 1:
        return
    if experts == 0:
        raise ValueError(f"{FIELD} = {ep}: the policy is a dense model (no routed experts); set it to 1")
    if world % ep:
        raise ValueError(f"{FIELD} = {ep} does not divide the {world} learner ranks")
    if experts % ep:
        raise ValueError(f"{FIELD} = {ep} does not divide the model's {experts} routed experts per layer")
    if replicate > 1:
        raise ValueError(f"{FIELD} = {ep} with fsdp.replicate = {replicate}: not supported together")
    if cpu_offload:
        raise ValueError(f"{FIELD} = {ep} with fsdp.cpu_offload: not supported together")


def check_config(config: LearnerConfig, ranks: Ranks) -> None:
    """`check` of `config.fsdp.expert_parallel` on `ranks` before anything is built (the model's experts
    read from its config.json); a no-op on one process (every `fsdp` field is ignored there)."""
    ep = config.fsdp.expert_parallel
    if ep == 1 or not ranks.distributed:
        return
    from transformers import AutoConfig

    from offpolicy.learner.model.moe import num_experts

    experts = num_experts(AutoConfig.from_pretrained(str(config.model_path)))
    check(ep, ranks.world_size, experts, replicate=config.fsdp.replicate, cpu_offload=config.fsdp.cpu_offload)


def rank_device() -> torch.device:
    """This rank's training device: its GPU under NCCL, else the CPU (gloo)."""
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def expert_mesh(ep: int, device: torch.device) -> DeviceMesh:
    """The `(dp, ep)` mesh of every rank (`ep` consecutive ranks per ep group); one per process, reused."""
    key = (ep, device.type)
    if key not in _MESHES:
        world = dist.get_world_size()
        _MESHES[key] = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
        log.info("expert parallelism: %d ep groups of %d ranks", world // ep, ep)
    return _MESHES[key]


_MESHES: dict[tuple[int, str], DeviceMesh] = {}


def experts_modules(root: nn.Module) -> list[nn.Module]:
    """The fused experts modules of `root` (transformers 5: 3-D `gate_up_proj` and `down_proj`)."""
    out = []
    for m in root.modules():
        gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3:
            out.append(m)
    return out


def shard_experts(root: nn.Module, ep: int, device: torch.device, fsdp_kwargs: dict[str, Any]) -> int:
    """Cut every experts module of `root` over the ep groups, `fully_shard` it over `dp`, and replace its
    forward with `ep_forward` (in place, before the decoder layers are sharded: FSDP2 then leaves these
    units to themselves). Works on meta parameters (lean start) and real ones; returns the count."""
    mesh = expert_mesh(ep, device)
    ep_mesh, me = mesh["ep"], mesh["ep"].get_local_rank()
    modules = experts_modules(root)
    if not modules:
        raise ValueError(f"{FIELD} = {ep}: no fused experts modules (3-D gate_up_proj) in the policy")
    for m in modules:
        if getattr(m, "has_bias", False) or not getattr(m, "has_gate", True):
            raise ValueError(f"{FIELD}: {type(m).__name__} has biases or no gate; not supported")
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(m, name)
            per = p.shape[0] // ep
            local = p.detach()[me * per : (me + 1) * per]  # (E/ep, ...)
            if local.device.type != "meta":
                local = local.to(device).clone()
            dt = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
            )
            setattr(m, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        m._ep, m._ep_group = ep, ep_mesh.get_group()
        m.forward = types.MethodType(ep_forward, m)
        fully_shard(m, mesh=mesh["dp"], **fsdp_kwargs)
    return len(modules)


class _GradScale(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _local(w: torch.Tensor, ep: int) -> torch.Tensor:
    """This rank's experts of a (gathered) expert parameter, its gradient scaled by 1 / ep."""
    local = w.to_local() if isinstance(w, DTensor) else w
    return _GradScale.apply(local, 1.0 / ep)


def ep_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output (T, H) for tokens `hidden_states` (T, H) routed to experts `top_k_index`
    (T, k) with weights `top_k_weights` (T, k), this rank holding experts [j E/ep, (j+1) E/ep) of the ep
    group: a collective over the group (every rank calls it, in the same order)."""
    from transformers.integrations.moe import _grouped_linear

    ep, group = self._ep, self._ep_group
    num_e, (tokens, hidden), k = self.num_experts, hidden_states.shape, top_k_index.shape[-1]
    per = num_e // ep
    flat = top_k_index.reshape(-1)  # (S,) S = T k
    order = torch.argsort(flat, stable=True)  # (S,) pairs sorted by expert
    sent = hidden_states[order // k]  # (S, H)
    counts = torch.bincount(flat, minlength=num_e)  # (E,)
    got = torch.empty_like(counts)  # (E,): [source rank][local expert]
    dist.all_to_all_single(got, counts, group=group)
    send_splits = counts.view(ep, per).sum(1).tolist()
    recv_splits = got.view(ep, per).sum(1).tolist()
    received = all_to_all_single_autograd(sent, recv_splits, send_splits, group)  # (R, H)
    local_ids = torch.arange(per, device=flat.device).repeat(ep).repeat_interleave(got)  # (R,)
    regroup = torch.argsort(local_ids, stable=True)  # (R,) rows by local expert
    offsets = torch.cumsum(got.view(ep, per).sum(0), 0, dtype=torch.int32)  # (E/ep,)
    transposed = getattr(self, "is_transposed", False)
    gate_up, down = _local(self.gate_up_proj, ep), _local(self.down_proj, ep)  # (E/ep, 2I, H), (E/ep, H, I)
    if received.shape[0] == 0:  # no token for these experts: keep them in the graph (zero gradients), so
        y = received + 0 * (gate_up.sum() + down.sum())  # FSDP reduces them on every rank alike; (0, H)
    else:
        x = _grouped_linear(received[regroup], gate_up, offsets, is_transposed=transposed)  # (R, 2I)
        y = _grouped_linear(self._apply_gate(x), down, offsets, is_transposed=transposed)  # (R, H)
    back = y[torch.argsort(regroup)]  # (R, H) in received order
    returned = all_to_all_single_autograd(back, send_splits, recv_splits, group)  # (S, H)
    weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # (S, H)
    out = weighted[torch.argsort(order)].view(tokens, k, hidden).sum(dim=1)  # (T, H)
    return out.to(hidden_states.dtype)
