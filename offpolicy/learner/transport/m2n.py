"""`transfer.backend: nccl_m2n | gloo_m2n`: every learner rank sends its own FSDP shards; nothing is gathered.

vLLM's m2n engines put trainer ranks `[0, T)` and the inference workers in one group, and every trainer
rank sends its local shards in every update (`nccl_m2n` reshards them on the GPUs with NCCL's m2n;
`gloo_m2n`, weights/engines/gloo_m2n.py, is its CPU stand-in). The actors' side is unchanged: the
members, the control calls and the faults are `VllmTransport`'s, run by rank 0, the only rank that talks
to Redis. What the other ranks need, they get from rank 0 over the learner's control group at each
publish (msgpack, never pickle):

1. `busy`: whether any rank's last send is still unwinding (then this send fails on every rank);
2. the plan: the members' ranks (`workers`), whether the group is formed again (a new epoch) and where
   its store listens;
3. after the send, bounded by `timeout_s` on every rank, whether it succeeded on every rank: the learner
   ranks agree, so a failure tears the group down everywhere and the next send forms it again.

With hybrid sharding (`fsdp.replicate`), `gloo_m2n`'s trainer ranks are the first replica group (which
holds every shard); the other replicas join the agreement only. `nccl_m2n`'s are every rank (vLLM's
engine reads the 2-D mesh off the parameters).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from offpolicy.learner.transport.address import check_bindable
from offpolicy.learner.transport.base import TransferResult
from offpolicy.learner.transport.fanout import FanoutClient
from offpolicy.learner.transport.vllm import (
    VllmTransport,
    _free_port,
    _inner,
    transfer_device,
)

if TYPE_CHECKING:
    from offpolicy.learner.distributed.ranks import Ranks
    from offpolicy.weights.config import TransferConfig
    from offpolicy.weights.control import LearnerControl, Member


def _wire(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict's tensors under their first name (a tied tensor once, as the file generations hold
    it), sharded or not: tied names hold the same parameter object (`unique_state` compares storages,
    which a DTensor does not expose)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


class LocalShards:
    """This rank's part of the learner's weights in the publish dtype (the state-dict names the file
    generations use): FSDP2's rows of dimension 0, replicated tensors whole on trainer rank 0 only.

    `trainers` / `trainer_rank`: the ranks of the first replica group (every rank without hybrid sharding)
    and this rank's place among them (None: a rank of another replica group, which sends nothing)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, rank: int) -> None:
        self.model, self.dtype = model, dtype
        self.trainers, self.trainer_rank = 1, 0 if rank == 0 else None
        for name, t in _state(model).items():
            if not isinstance(t, DTensor):
                continue
            *outer, last = t.placements
            if last != Shard(0) or any(p != Replicate() for p in outer):
                raise ValueError(f"m2n sends FSDP2's rows of dimension 0: {name} is placed {t.placements}")
            mesh = t.device_mesh
            coord = mesh.get_coordinate() or []
            self.trainers = mesh.size(mesh.ndim - 1)
            self.trainer_rank = coord[-1] if all(c == 0 for c in coord[:-1]) else None
        if self.trainer_rank is not None and self.trainer_rank != rank:
            raise ValueError(f"rank {rank} holds shard {self.trainer_rank}: the trainer ranks must be [0, T)")

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...], int | None]]:
        return [
            (n, _wire(t, self.dtype), tuple(t.shape), 0 if isinstance(t, DTensor) else None)
            for n, t in _state(self.model).items()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in _state(self.model).items():
            if isinstance(t, DTensor):
                local = t.to_local()
            else:
                local = t if self.trainer_rank == 0 else t.new_empty(0)
            yield name, local.detach().to(_wire(t, self.dtype)).cpu()


def _vllm_m2n_source(model: torch.nn.Module, dtype: torch.dtype, world: int):
    """vLLM's `DTensorModuleSource` over the state-dict names, cast to the publish dtype (`nccl_m2n`)."""
    from vllm.distributed.weight_transfer.m2n_common import M2NParamMeta
    from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource, placements_from_tensor

    class CastSource(DTensorModuleSource):
        def metadata(self):
            return [
                M2NParamMeta(n, _wire(t, dtype), tuple(t.shape), placements_from_tensor(t))
                for n, t in _state(model).items()
            ]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for n, t in _state(model).items():
                yield n, (t.to_local() if isinstance(t, DTensor) else t).detach().to(_wire(t, dtype))

    return CastSource(model, world)


def _broadcast(ranks: Ranks, doc: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's `doc` on every rank (msgpack over the control group)."""
    if ranks.control is None:
        assert doc is not None
        return doc
    data = msgpack.packb(doc) if ranks.is_leader else b""
    size = torch.tensor([len(data)], dtype=torch.long)
    dist.broadcast(size, src=0, group=ranks.control)
    buf = torch.empty(int(size), dtype=torch.uint8)
    if ranks.is_leader:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=ranks.control)
    return doc if ranks.is_leader and doc is not None else msgpack.unpackb(buf.numpy().tobytes())


def _reduce(ranks: Ranks, value: int, op: dist.ReduceOp.RedOpType) -> int:
    """`value` reduced over the ranks by `op` (every rank gets the same answer)."""
    t = torch.tensor([value], dtype=torch.long)
    if ranks.control is not None:
        dist.all_reduce(t, op=op, group=ranks.control)
    return int(t.item())


def _any(ranks: Ranks, flag: bool) -> bool:
    """Whether `flag` holds on any rank."""
    return bool(_reduce(ranks, int(flag), dist.ReduceOp.MAX))


class ShardedTransport(VllmTransport):
    """`publish.transport: vllm` with an m2n backend, on every learner rank (`control`: rank 0's only)."""

    def __init__(
        self,
        config: TransferConfig,
        control: LearnerControl | None,
        model: torch.nn.Module,
        dtype: torch.dtype,
        ranks: Ranks,
    ) -> None:
        self.config, self.control, self.ranks = config, control, ranks
        if ranks.is_leader:  # rank 0 binds the group's rendezvous store; the others connect to it
            check_bindable(config.address)
        self.device = transfer_device(config.backend, ranks.local_rank)
        if config.backend == "gloo_m2n":
            from offpolicy.weights.engines.plugin import register

            register()
            self.source: Any = LocalShards(model, dtype, ranks.rank)
            self.trainers, self.trainer_rank = self.source.trainers, self.source.trainer_rank
        else:  # nccl_m2n: vLLM's engine; every rank is a trainer rank
            self.source = _vllm_m2n_source(model, dtype, ranks.world_size)
            self.trainers, self.trainer_rank = ranks.world_size, ranks.rank
        self._init_group_state()
        self._members: list[Member] = []  # rank 0: the group's members
        self._next: list[Member] = []  # rank 0: the members of the group the current plan forms

    def send(self, version: int) -> TransferResult:
        """Every rank, in step: the plan from rank 0, each trainer rank's send (bounded by `timeout_s`),
        then the ranks' agreement on the outcome."""
        t0 = time.perf_counter()
        if _any(self.ranks, self.busy):
            return TransferResult(version, 0.0, ok=False, error="the previous send is still unwinding")
        plan = _broadcast(self.ranks, self._plan() if self.ranks.is_leader else None)
        if not plan["workers"]:
            self._teardown()
            return TransferResult(version, 0.0, group_size=0)
        outcome: dict[str, Any] = {}
        if self.trainer_rank is not None:
            self._thread = threading.Thread(
                target=self._run_rank, args=(version, plan, outcome), name="offpolicy-transfer", daemon=True
            )
            self._thread.start()
            self._thread.join(self.config.timeout_s)
            if self._thread.is_alive():  # stuck: it ends in the background, sends fail at once until then
                self.stuck += 1
                outcome.setdefault("error", f"no result in {self.config.timeout_s:g} s")
        seconds = time.perf_counter() - t0
        members = self._members
        if _any(self.ranks, bool(outcome.get("error"))):
            error = outcome.get("error") or "the send failed on another learner rank"
            if self.ranks.is_leader:
                self._failed(members, outcome.get("culprits"))
            else:
                self._teardown()
            return TransferResult(version, seconds, 0, len(members), ok=False, error=error)
        for m in members:
            self._benched.pop(m.actor_id, None)
        sent = _reduce(self.ranks, outcome.get("bytes", 0), dist.ReduceOp.SUM)  # every rank's share
        return TransferResult(version, seconds, sent, len(members))

    def _plan(self) -> dict[str, Any]:
        """Rank 0: this send's members, and whether (and where) the group forms again."""
        self._sends += 1
        members = [m for m in self.control.members() if self._admitted(m)]  # type: ignore[union-attr]
        for m in members:
            self._stalled.pop(m.actor_id, None)
        current = [(m.actor_id, m.incarnation) for m in self._members] if self.engine is not None else None
        reform = current != [(m.actor_id, m.incarnation) for m in members]
        self._next = members
        return {
            "workers": sum(m.workers for m in members),
            "reform": reform,
            "port": (self.config.port or _free_port()) if reform and members else 0,
        }

    def _run_rank(self, version: int, plan: dict[str, Any], outcome: dict[str, Any]) -> None:
        self._attempt(version, outcome, (lambda: self._form_rank(plan)) if plan["reform"] else None)

    def _form_rank(self, plan: dict[str, Any]) -> None:
        """Tear the old group down and join the new one as trainer rank `trainer_rank` (rank 0 with the
        members' control calls)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self._teardown()
        self.epoch += 1
        cfg = self.config
        world = self.trainers + plan["workers"]
        client = None
        if self.ranks.is_leader:
            self._members = self._next
            client = FanoutClient(self.control, self._members, self.epoch, _inner(cfg))  # type: ignore[arg-type]
        info = _trainer_init_info(cfg, plan["port"], world, self.trainers, self.trainer_rank or 0)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)
        self.client = client

    def _teardown(self) -> None:
        super()._teardown()  # a follower has no client: its engine only
        self._members = []

    def close(self) -> None:
        self._teardown()
        if self.control is not None:
            self.control.close()


def _trainer_init_info(cfg: TransferConfig, port: int, world: int, trainers: int, rank: int):
    """vLLM's trainer init info for an m2n backend: this rank's place among the `trainers` senders."""
    if cfg.backend == "gloo_m2n":
        from offpolicy.weights.engines.gloo_m2n import GlooM2NTrainerInitInfo

        return GlooM2NTrainerInitInfo(
            rank=rank,
            master_address=cfg.address,
            master_port=port,
            world_size=world,
            num_trainer_ranks=trainers,
            packed_buffer_size_bytes=cfg.bucket_bytes,
            timeout_s=_inner(cfg),
        )
    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

    return M2NTrainerInitInfo(
        rank=rank, master_address=cfg.address, master_port=port, world_size=world, num_trainer_ranks=trainers
    )
