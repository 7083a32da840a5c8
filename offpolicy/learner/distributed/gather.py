"""Full weights of a sharded module, gathered to rank 0 alone, in bounded buckets, in the publish dtype.

This module is the description of that gather; persist/background_gather.py runs the same gather off
the step's critical path. `GatheredWeights` stands in for `persist.file_generation.HostCopy` when the learner
runs on N ranks: every rank constructs one at the same step boundary (a collective); only the leader's
holds tensors.

The tensors are taken in state-dict order in buckets of about `bucket_bytes` (in the publish dtype; a
larger tensor is a bucket of its own). For a bucket, each rank of rank 0's shard group (every rank; with
hybrid sharding the ranks of rank 0's replica group, which together hold every shard, while the other
replica groups send nothing) casts its shards to the publish dtype, packs them into one flat buffer on
its device and sends it with one `gather` to rank 0: the other ranks never receive full tensors (an
all-gather would give every rank every tensor). Rank 0 copies the gathered bucket to host memory (through
one pinned staging buffer of the bucket's size on CUDA), and from there each shard's rows into the full
host tensors the writer reads. Rank 0's extra device memory and its pinned host memory are one bucket
(`publish.gather_bucket_mb`), whatever the model's size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

DEFAULT_BUCKET_BYTES = 256 * 2**20


def rows_of(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows [start, stop) of part `i` when `n` rows are cut in `parts` as `torch.chunk` cuts (FSDP2)."""
    size = -(-n // parts) if n else 0
    start = min(n, i * size)
    return start, min(n, start + size)


def layout_of(t: torch.Tensor) -> tuple[dist.ProcessGroup, int, bool] | None:
    """(shard group, its size, whether this rank sends) of an FSDP2 parameter sharded on dim 0 over the
    last mesh dimension (replicated over any other); None for another layout (gathered whole)."""
    if not isinstance(t, DTensor):
        return None
    *outer, last = t.placements
    if last != Shard(0) or any(p != Replicate() for p in outer):
        return None
    mesh = t.device_mesh
    coord = mesh.get_coordinate() or []
    sends = all(c == 0 for c in coord[:-1])  # rank 0's replica group
    return mesh.get_group(mesh.ndim - 1), mesh.size(mesh.ndim - 1), sends


class GatheredWeights:
    """The full weights of a sharded module in rank 0's host memory, in the publish dtype (a collective:
    every rank constructs one; only the leader's holds tensors). Stands in for
    `persist.file_generation.HostCopy`.

    `into`: host tensors to reuse (matching name, shape and dtype). The host tensors are pageable; on
    CUDA one pinned staging buffer of a bucket's size carries each bucket off the device. `wait()` returns
    the host tensors (complete when the constructor returns)."""

    def __init__(
        self,
        module: nn.Module,
        keys: set[str],
        dtype: torch.dtype,
        leader: bool,
        into: dict[str, torch.Tensor] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.buckets = 0
        self.max_bucket_bytes = 0  # the largest bucket rank 0 received (device and pinned staging)
        self._staging: torch.Tensor | None = None
        state = [
            (k, t.detach()) for k, t in module.state_dict().items() if k in keys
        ]  # same order everywhere
        bucket: list[tuple[str, torch.Tensor, torch.dtype]] = []
        size = 0
        for name, t in state:
            want = dtype if t.is_floating_point() else t.dtype
            if leader:
                self.tensors[name] = host_buffer(into, name, t.shape, want)
            layout = layout_of(t)
            if layout is None:  # not sharded on dim 0: whole, one tensor at a time
                self._flush(bucket, leader)
                bucket, size = [], 0
                full = full_tensor(t, want)
                if leader:
                    self.tensors[name].copy_(full)
                continue
            n = t.numel() * want.itemsize
            if bucket and size + n > bucket_bytes:
                self._flush(bucket, leader)
                bucket, size = [], 0
            bucket.append((name, t, want))
            size += n
        self._flush(bucket, leader)
        self._staging = None

    def _flush(self, bucket: list[tuple[str, torch.Tensor, torch.dtype]], leader: bool) -> None:
        """Gather one bucket's shards to rank 0 of the shard group and copy them into the host tensors."""
        if not bucket:
            return
        group, parts, sends = layout_of(bucket[0][1])  # type: ignore[misc]
        if not sends:
            return
        first = bucket[0][1]
        kind = first.device_mesh.device_type
        device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
        me = dist.get_rank(group)
        # per rank of the group: its shard of each tensor, packed in bucket order, as bytes
        sizes = part_sizes([(t.shape, want) for _, t, want in bucket], parts)
        width = max(sizes)
        flat = torch.zeros(width, dtype=torch.uint8, device=device)
        at = 0
        for _, t, want in bucket:
            local = t.to_local()
            if local.numel():
                nbytes = local.numel() * want.itemsize
                flat[at : at + nbytes].copy_(
                    local.to(device=device, dtype=want).contiguous().view(-1).view(torch.uint8)
                )
                at += nbytes
        out = (
            [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(parts)] if me == 0 else None
        )
        dist.gather(flat, out, group_dst=0, group=group)
        if me != 0 or not leader:
            return
        self.buckets += 1
        self.max_bucket_bytes = max(self.max_bucket_bytes, width * parts)
        for r, part in enumerate(out):  # type: ignore[arg-type]
            host = part[: sizes[r]]
            if host.is_cuda:  # one pinned staging buffer, reused bucket after bucket
                if self._staging is None or self._staging.numel() < host.numel():
                    self._staging = torch.empty(max(host.numel(), width), dtype=torch.uint8, pin_memory=True)
                stage = self._staging[: host.numel()]
                stage.copy_(host)
                host = stage
            unpack_rows(self.tensors, [(name, t.shape, want) for name, t, want in bucket], parts, r, host)

    def wait(self) -> dict[str, torch.Tensor]:
        """The host tensors (the leader's; empty elsewhere): complete once the constructor returned."""
        return self.tensors


def row_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one dim-0 row of a tensor of `shape` in `dtype`."""
    return dtype.itemsize * math.prod(shape[1:])


def host_buffer(
    into: dict[str, torch.Tensor] | None, name: str, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The leader's host tensor for `name`: the one in `into` when its shape and dtype match, else new."""
    buf = into.get(name) if into is not None else None
    if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
        buf = torch.empty(tuple(shape), dtype=dtype)
    return buf


def part_sizes(entries: Sequence[tuple[Sequence[int], torch.dtype]], parts: int) -> list[int]:
    """Per rank of a shard group of `parts`: the bytes of its rows of every (shape, dtype) of a bucket."""
    return [
        sum((rows_of(s[0], parts, r)[1] - rows_of(s[0], parts, r)[0]) * row_bytes(s, d) for s, d in entries)
        for r in range(parts)
    ]


def unpack_rows(
    tensors: dict[str, torch.Tensor],
    entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
    parts: int,
    rank: int,
    host: torch.Tensor,
) -> None:
    """Copy rank `rank`'s packed bytes of a bucket (`host`, its rows of each entry in order) into the rows
    of the full host `tensors`."""
    at = 0
    for name, shape, dtype in entries:
        start, stop = rows_of(shape[0], parts, rank)
        nbytes = (stop - start) * row_bytes(shape, dtype)
        if nbytes:
            tensors[name][start:stop].copy_(host[at : at + nbytes].view(dtype).view(stop - start, *shape[1:]))
        at += nbytes


def full_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
