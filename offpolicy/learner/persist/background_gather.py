"""Full weights of a sharded module gathered to rank 0 off the critical path (N ranks, `publish`).

At a step boundary every rank (a collective) takes a snapshot of its own shards of the weights to publish,
cast to the publish dtype, into host memory (`persist.published.HostCopy`: on CUDA a side stream into
pinned buffers, overlapping the next forward). That is all the step waits for, at its next optimizer step
(`released`), as on one process. A helper thread on every rank of rank 0's shard group then gathers the
snapshots to rank 0 in buckets of about `bucket_bytes` over a process group of its own (the training's
collectives go on in the main thread meanwhile), and rank 0 copies each bucket's rows into the full host
tensors its writer reads (`wait`). The ranks' memory for it: their shards in pinned host memory, one
bucket on the device for NCCL (rank 0: the gathered bucket, and one pinned staging buffer to host), and
rank 0's full host tensors, reused version after version. One gather is in flight at a time: the next
publish waits for the previous one (every rank, so that the group's gathers pair up in order).

Tensors that are not FSDP2 row shards (none in a model sharded by `distributed.fsdp.shard`) are gathered
whole at once, in the step, as `distributed.gather.GatheredWeights` does.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from offpolicy.learner.distributed.gather import (
    DEFAULT_BUCKET_BYTES,
    full_tensor,
    host_buffer,
    layout_of,
    part_sizes,
    unpack_rows,
)
from offpolicy.learner.persist.published import HostCopy

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def publish_group(ranks: list[int]) -> dist.ProcessGroup:
    """The process group the background gathers of `ranks` run on, created once per process: a collective
    of every rank (`new_group`), so every rank asks for it at the same publish."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


def close_publish_groups() -> None:
    """Destroy this process's publish groups (every gather waited for first): a gloo group left to the
    interpreter's exit can abort the process while its threads are torn down."""
    while _GROUPS:
        _, group = _GROUPS.popitem()
        dist.destroy_process_group(group)


def _group_ranks(t: DTensor) -> list[int]:
    """The global ranks of rank 0's shard group (the last mesh dimension, at the other coordinates 0)."""
    mesh = t.device_mesh.mesh
    while mesh.dim() > 1:
        mesh = mesh[0]
    return [int(r) for r in mesh.tolist()]


class BackgroundGather:
    """The full weights of a sharded module in rank 0's host memory, in the publish dtype, gathered on a
    helper thread (every rank constructs one at the same step boundary; only the leader's holds tensors).

    `released()`: the sources may change (the shards' host snapshot is complete); `wait()`: the gather is
    complete, the host tensors (the leader's; empty elsewhere)."""

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
        self._entries: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []  # name, shape, dtype, parts
        shards: dict[str, torch.Tensor] = {}
        group_ranks: list[int] | None = None
        sends = False
        for name, t in ((k, v.detach()) for k, v in module.state_dict().items() if k in keys):
            want = dtype if t.is_floating_point() else t.dtype
            if leader:
                self.tensors[name] = host_buffer(into, name, t.shape, want)
            layout = layout_of(t)
            if layout is None:  # not row-sharded: whole, now (a collective of the step)
                full = full_tensor(t, want)
                if leader:
                    self.tensors[name].copy_(full)
                continue
            _, parts, sends = layout
            group_ranks = group_ranks or _group_ranks(t)  # type: ignore[arg-type]
            self._device = t.to_local().device if t.device_mesh.device_type == "cuda" else torch.device("cpu")
            if t.to_local().device.type == "cpu" and t.device_mesh.device_type == "cuda":
                self._device = torch.device("cuda", torch.cuda.current_device())  # CPU-offloaded shards
            shards[name] = t.to_local()
            self._entries.append((name, tuple(t.shape), want, parts))
        self._leader, self._bucket_bytes = leader, bucket_bytes
        self._group = publish_group(group_ranks) if group_ranks is not None else None
        self._snapshot = HostCopy(shards, dtype) if sends and self._entries else None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="offpolicy-publish-gather", daemon=True)
        self._thread.start()

    def released(self) -> None:
        """Block until the shards' host snapshot is complete: the weights may change from then on."""
        if self._snapshot is not None:
            self._snapshot.wait()

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until the gather is complete; the leader's host tensors (empty on the other ranks)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.tensors

    # --- the helper thread

    def _run(self) -> None:
        try:
            if self._snapshot is None:
                return  # not in rank 0's shard group (HSDP), or nothing row-sharded
            local = self._snapshot.wait()
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the thread's own current device: the rank's
            bucket: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
            size = 0
            for entry in self._entries:
                n = math.prod(entry[1]) * entry[2].itemsize
                if bucket and size + n > self._bucket_bytes:
                    self._flush(bucket, local)
                    bucket, size = [], 0
                bucket.append(entry)
                size += n
            self._flush(bucket, local)
        except BaseException as e:  # re-raised in wait(), where the writer reports it
            self._error = e

    def _flush(self, bucket: list[tuple[str, tuple[int, ...], torch.dtype, int]], local: dict) -> None:
        if not bucket:
            return
        parts = bucket[0][3]
        me = dist.get_rank(self._group)
        sizes = part_sizes([(s, w) for _, s, w, _ in bucket], parts)
        width = max(sizes)
        flat = torch.zeros(width, dtype=torch.uint8)
        at = 0
        for name, _, _, _ in bucket:
            shard = local[name]
            if shard.numel():
                nbytes = shard.numel() * shard.dtype.itemsize
                flat[at : at + nbytes].copy_(shard.contiguous().view(-1).view(torch.uint8))
                at += nbytes
        flat = flat.to(self._device)
        out = (
            [torch.empty(width, dtype=torch.uint8, device=self._device) for _ in range(parts)]
            if me == 0
            else None
        )
        dist.gather(flat, out, group_dst=0, group=self._group)
        if me != 0 or not self._leader:
            return
        self.buckets += 1
        for r, part in enumerate(out):  # type: ignore[arg-type]
            entries = [(name, shape, want) for name, shape, want, _ in bucket]
            unpack_rows(self.tensors, entries, parts, r, part[: sizes[r]].cpu())
