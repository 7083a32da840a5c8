"""A `gloo_m2n` weight-transfer engine pair for vLLM's factory: vLLM's `nccl_m2n` over gloo.

The structure is vLLM's `m2n_engine.py` / `m2n_trainer.py`: trainer ranks occupy `[0, T)` of one group and
the inference workers follow; every trainer rank sends its own local shards (FSDP2's rows of dimension 0)
and none gathers a full tensor, which the broadcast backends (`nccl`, `gloo`) make rank 0 do. Both sides
know the plan from the init handshake (names, dtypes, full shapes, each tensor's placement: rows of
dimension 0 cut over the T trainer ranks as `torch.chunk` cuts, or replicated and sent by trainer rank 0),
cut the stream into the same buckets (`gloo_engine.buckets`, by full sizes), and for each bucket every
trainer rank sends one packed buffer of its rows to every worker (point to point). A worker puts each
tensor together from the trainer ranks' rows and loads the bucket through the model's `load_weights`
inside vLLM's layerwise-reload lifecycle, as the `gloo` engine does. Every wait is bounded by the group's
`timeout_s`.

It is the CPU stand-in of `nccl_m2n` (whose `nccl.m2n.reshard` also reshards into a tensor-parallel
destination; this one delivers whole tensors): the tests drive a learner on N ranks through it, exactly as
they would drive vLLM's M2N engines on GPUs. Registered by `offpolicy.weights.engines.plugin.register`.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from offpolicy.weights.engines.gloo import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    LayerwiseGlooReceiver,
    buckets,
    init_group,
)

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from torch.distributed import ProcessGroup

BACKEND = "gloo_m2n"
ROWS = 0  # placement code: rows of dimension 0 over the trainer ranks (vLLM's m2n `Shard(0)`)


class ShardedSource(Protocol):
    """What the trainer side reads: one entry per tensor, in a stable order on every trainer rank."""

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...], int | None]]:
        """(name, wire dtype, full shape, placement: `ROWS` or None = replicated) per tensor."""
        ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's rows in the wire dtype) per tensor; replicated ones whole (or empty)."""
        ...


def rows(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows [start, stop) of part `i` when `n` rows are cut in `parts` as `torch.chunk` cuts (FSDP2)."""
    size = -(-n // parts) if n else 0
    start = min(n, i * size)
    return start, min(n, start + size)


def part_bytes(shape: Sequence[int], dtype: torch.dtype, placement: int | None, parts: int, i: int) -> int:
    """Bytes trainer rank `i` of `parts` sends of a tensor: its rows, or all of it (rank 0, replicated)."""
    if placement is None:
        return math.prod(shape) * dtype.itemsize if i == 0 else 0
    start, stop = rows(shape[0], parts, i)
    return (stop - start) * math.prod(shape[1:]) * dtype.itemsize


@dataclass(kw_only=True)
class GlooM2NWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker side: the rendezvous, the group's layout and the whole plan."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    num_trainer_ranks: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    placements: list[int | None]
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        n = len(self.names)
        if not n == len(self.dtype_names) == len(self.shapes) == len(self.placements):
            raise ValueError("names, dtype_names, shapes and placements differ in length")
        if not 0 < self.num_trainer_ranks <= self.rank_offset < self.world_size:
            raise ValueError(
                f"trainer ranks {self.num_trainer_ranks}, rank offset {self.rank_offset} and world size "
                f"{self.world_size} cannot form a group"
            )
        if any(p not in (ROWS, None) for p in self.placements):
            raise ValueError(f"placements must be {ROWS} (rows) or null (replicated)")


@dataclass
class GlooM2NWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: the names the trainer sends, which must be the plan's (a check, as vLLM's m2n does)."""

    names: list[str]


@dataclass(kw_only=True)
class GlooM2NTrainerInitInfo(TrainerInitInfo):
    """Trainer side (every trainer rank): `rank` is this rank's place in `[0, num_trainer_ranks)`; rank 0
    hosts the group's store and drives the inference side."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    num_trainer_ranks: int = 1
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class _Plan:
    """The plan both sides cut the stream by: dtypes, full shapes, placements, the buckets."""

    def __init__(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        placements: list[int | None],
        trainers: int,
        bucket_bytes: int,
    ) -> None:
        self.names, self.dtypes, self.shapes, self.placements = names, dtypes, shapes, placements
        self.trainers = trainers
        sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
        self.buckets = list(buckets(sizes, bucket_bytes))

    def part(self, i: int, rank: int) -> int:
        return part_bytes(self.shapes[i], self.dtypes[i], self.placements[i], self.trainers, rank)


class GlooM2NWeightTransferEngine(
    LayerwiseGlooReceiver,
    WeightTransferEngine[GlooM2NWeightTransferInitInfo, GlooM2NWeightTransferUpdateInfo],
):
    """Inference-worker side: joins the group, receives every trainer rank's rows of each bucket, puts the
    tensors together and loads them."""

    init_info_cls = GlooM2NWeightTransferInitInfo
    update_info_cls = GlooM2NWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: ProcessGroup | None = None
        self.plan: _Plan | None = None

    def init_transfer_engine(self, init_info: GlooM2NWeightTransferInitInfo) -> None:
        self.shutdown()  # a re-formed group replaces the old one
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.plan = _Plan(
            init_info.names,
            [getattr(torch, d) for d in init_info.dtype_names],
            init_info.shapes,
            init_info.placements,
            init_info.num_trainer_ranks,
            init_info.packed_buffer_size_bytes,
        )
        self.group = init_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def receive_weights(self, update_info: GlooM2NWeightTransferUpdateInfo) -> None:
        if self.group is None or self.plan is None:
            raise RuntimeError("gloo_m2n weight transfer not initialized: call init_transfer_engine() first")
        plan = self.plan
        if update_info.names != plan.names:
            raise RuntimeError("the trainer sends other tensors than the plan this group was formed with")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            for tag, (start, end) in enumerate(plan.buckets):
                parts = []
                for r in range(plan.trainers):  # one packed buffer per trainer rank (none when empty)
                    size = sum(plan.part(i, r) for i in range(start, end))
                    buf = torch.empty(size, dtype=torch.uint8)
                    if size:
                        self.group.recv([buf], r, tag).wait()
                    parts.append(buf)
                self.model.load_weights(list(_assemble(plan, start, end, parts)))


def _assemble(
    plan: _Plan, start: int, end: int, parts: list[torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of bucket [start, end) from each trainer rank's packed rows."""
    offsets = [0] * plan.trainers
    for i in range(start, end):
        shape, dtype = plan.shapes[i], plan.dtypes[i]
        pieces = []
        for r in range(plan.trainers):
            n = plan.part(i, r)
            if n:
                flat = parts[r][offsets[r] : offsets[r] + n].view(dtype)
                pieces.append(flat.view(-1, *shape[1:]) if shape else flat.view(shape))
                offsets[r] += n
        full = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        yield plan.names[i], full.view(shape)


class GlooM2NTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooM2NTrainerInitInfo]):
    """Trainer side, on every trainer rank: joins the group and sends its rows of every bucket to every
    worker; rank 0 (the controller) also drives the inference side through `client`."""

    init_info_cls = GlooM2NTrainerInitInfo

    def __init__(self, *, client, source, is_controller: bool, rank: int, world_size: int) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.is_controller, self.rank, self.world_size = is_controller, rank, world_size
        self.group: ProcessGroup | None = None
        self.plan: _Plan | None = None
        self.bytes_sent = 0

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooM2NTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: Any = None,
    ) -> Self:
        if source is None or not hasattr(source, "plan"):
            raise TypeError("gloo_m2n needs a source that states each tensor's layout (ShardedSource)")
        if not 0 <= init_info.rank < init_info.num_trainer_ranks < init_info.world_size:
            raise ValueError(
                f"trainer rank {init_info.rank} of {init_info.num_trainer_ranks} in a group of "
                f"{init_info.world_size} leaves no worker"
            )
        engine = cls(
            client=client,
            source=source,
            is_controller=init_info.rank == 0,
            rank=init_info.rank,
            world_size=init_info.world_size,
        )
        entries = source.plan()
        names = [n for n, *_ in entries]
        engine.plan = _Plan(
            names,
            [d for _, d, _, _ in entries],
            [list(s) for _, _, s, _ in entries],
            [p for *_, p in entries],
            init_info.num_trainer_ranks,
            init_info.packed_buffer_size_bytes,
        )
        worker_info = GlooM2NWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=init_info.num_trainer_ranks,
            world_size=init_info.world_size,
            num_trainer_ranks=init_info.num_trainer_ranks,
            names=names,
            dtype_names=[str(d).removeprefix("torch.") for d in engine.plan.dtypes],
            shapes=engine.plan.shapes,
            placements=engine.plan.placements,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            timeout_s=init_info.timeout_s,
        )
        # The workers block in the rendezvous: the controller starts theirs on a side thread, then every
        # trainer rank opens its own.
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = (
                exe.submit(client.init_weight_transfer_engine, asdict(worker_info))
                if engine.is_controller
                else None
            )
            try:
                engine.group = init_group(
                    init_info.master_address,
                    init_info.master_port,
                    init_info.rank,
                    init_info.world_size,
                    init_info.timeout_s,
                )
            finally:
                if future is not None:
                    future.result()  # the inference side's error, if any (bounded by the client)
        return engine

    def send_weights(self) -> None:
        assert self.plan is not None and self.source is not None
        if not self.is_controller:
            self._send()
            return
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(
                self.client.update_weights, asdict(GlooM2NWeightTransferUpdateInfo(self.plan.names))
            )
            self._send()
            future.result()
        finally:
            exe.shutdown(wait=False)  # never join a receiver stuck on a dead peer: the error goes out
        self.client.finish_weight_update()

    def _send(self) -> None:
        """Every bucket: this rank's rows packed into one buffer, sent to every worker."""
        assert self.group is not None and self.plan is not None and self.source is not None
        plan, pairs = self.plan, iter(self.source)
        self.bytes_sent = 0
        for tag, (start, end) in enumerate(plan.buckets):
            shards = []
            for i in range(start, end):
                name, t = next(pairs)
                if name != plan.names[i] or t.numel() * t.element_size() != plan.part(i, self.rank):
                    raise RuntimeError(
                        f"the source yielded {name} ({tuple(t.shape)}) where the plan has "
                        f"{plan.names[i]} ({plan.part(i, self.rank)} bytes from rank {self.rank})"
                    )
                if t.numel():
                    shards.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
            if not shards:
                continue
            packed = torch.cat(shards) if len(shards) > 1 else shards[0]
            works = [self.group.send([packed], w, tag) for w in range(plan.trainers, self.world_size)]
            for work in works:
                work.wait()
            self.bytes_sent += packed.numel() * len(works)

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.shutdown()
