"""The gather of distributed/gather.py (full weights to rank 0) run in the background (N ranks, `publish`).

What is gathered, by which ranks, in which buckets, is distributed/gather.py's (its docstring describes it);
here it runs from host snapshots, on a helper thread, off the step's critical path. At a step boundary every
rank (a collective) takes a snapshot of its own shards of the weights to publish, cast to the publish
dtype, into host memory (`persist.file_generation.HostCopy`: on CUDA a side stream into pinned buffers,
overlapping the next forward). That is all the step waits for, at its next optimizer step (`released`), as
on one process. Once started (`start`), a helper thread on every rank of rank 0's shard group runs the
bucketed gather over a gloo process group of its own, from and into host memory (the training's
collectives go on in the main thread meanwhile). Rank 0 either

- streams each bucket, as its tensors complete, to the writer (`stream()`: a queue of at most
  `STREAM_DEPTH` buckets; the writer writes them into the version's files as they come), so it never holds
  more than a few buckets of the full weights (`keep=False`, the files transport), or
- copies them into full host tensors (`wait()`), reused version after version, for a transport that sends
  a version from rank 0's host memory (`keep=True`).

The ranks' memory for it: their shards in host memory (one flat set, page-locked on CUDA at its exact
size: weights/host_buffers.py; reused by a later snapshot, `ShardSets`) and one bucket in
host memory (rank 0: the gathered bucket); rank 0: `STREAM_DEPTH` + 2 buckets streamed, or the full host
tensors kept. One gather is in flight at a time (every rank in step, so that the group's gathers pair up
in order: the caller, persist/durable_writes.py, decides when the next starts).

Why gloo, on CUDA too: the helper thread must never touch the device. A gather over NCCL from this thread
would copy each bucket to the device and back on the thread's current stream, the device's default stream,
which training uses: its copies would queue behind the training kernels already issued, and
ProcessGroupNCCL makes that stream wait for the gather. Rank A's training then waits for gather k, which
needs rank B's bucket, whose copy waits behind rank B's training, which waits in an FSDP collective for
rank A: a deadlock until the NCCL timeout, on every step whose publish overlaps training (the default,
`publish_every: 1`). A side stream would remove that wait but not the other: two NCCL communicators with
kernels in flight at once, issued in different orders on different ranks, which NCCL documents as a
source of hangs. Over gloo the thread only reads host memory the snapshot's copy finished (`released`,
an event the thread waits for on the host), sends and receives over TCP, and writes host memory: nothing
it does is ordered after or before any kernel of the training, so training and gather can interleave in
any order on any rank. The cost is bandwidth: a gather runs at the host network's speed (TCP between
nodes, loopback within one), not NVLink's; it is off the step's critical path, and a publish that outlasts
a step is coalesced with the next (persist/durable_writes.py), which `published_lag` shows.

Tensors that are not FSDP2 row shards (none in a model sharded by `distributed.fsdp.shard`) are gathered
whole at once, in the step, as `distributed.gather.GatheredWeights` does.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from offpolicy.learner.config.publish import STREAM_DEPTH
from offpolicy.learner.distributed.gather import (
    DEFAULT_BUCKET_BYTES,
    full_tensor,
    host_buffer,
    layout_of,
    part_sizes,
    unpack_rows,
)
from offpolicy.learner.persist.file_generation import HostCopy
from offpolicy.weights.safetensors_io import Entry, TensorStream

_END = object()
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


PUBLISH_BACKEND = "gloo"
"""The background gathers' backend, whatever the training's (module docstring: why never NCCL)."""


def publish_group(ranks: list[int]) -> dist.ProcessGroup:
    """The gloo process group the background gathers of `ranks` run on, created once per process: a
    collective of every rank (`new_group`), so every rank asks for it at the same publish."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), backend=PUBLISH_BACKEND)
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


class ShardSets:
    """A rank's shard snapshot sets, reused from one gather to the next (`BackgroundGather(shard_sets=)`): a
    set is free once its gather's thread does not run (finished, or never started: a waiting gather that a
    newer one replaces). At most two are kept: the one a gather in flight reads, and the newest."""

    def __init__(self) -> None:
        self._owned: list[tuple[dict[str, torch.Tensor], BackgroundGather]] = []

    @property
    def sets(self) -> list[dict[str, torch.Tensor]]:
        return [s for s, _ in self._owned]

    def acquire(self) -> dict[str, torch.Tensor] | None:
        """A set no running gather reads (None: allocate one)."""
        return next((s for s, gather in self._owned if not gather.reads()), None)

    def keep(self, gather: BackgroundGather) -> None:
        """Remember `gather`'s set, beside the one a gather in flight reads."""
        if (mine := gather.shards) is not None:
            busy = [(s, g) for s, g in self._owned if g.reads() and s is not mine][:1]
            self._owned = [*busy, (mine, gather)]


class BackgroundGather:
    """The full weights of a sharded module, in the publish dtype, gathered to rank 0 on a helper thread
    (every rank constructs one at the same step boundary and starts it at the same later one; only the
    leader's yields tensors).

    `released()`: the sources may change (the shards' host snapshot is complete); `start()`: the gather
    begins; `busy()`: it has not finished (the leader: or its stream is not written yet); `wait()`: the
    gather is complete, the kept host tensors (the leader's with `keep`; empty elsewhere); `stream()`: the
    leader's tensors as they arrive (without `keep`), for `write_version`."""

    def __init__(
        self,
        module: nn.Module,
        keys: set[str],
        dtype: torch.dtype,
        leader: bool,
        into: dict[str, torch.Tensor] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        keep: bool = True,
        shard_sets: ShardSets | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.buckets = 0
        self._entries: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []  # name, shape, dtype, parts
        self._whole: dict[str, torch.Tensor] = {}  # the leader's tensors gathered whole in the constructor
        shards: dict[str, torch.Tensor] = {}
        group_ranks: list[int] | None = None
        sends = False
        for name, t in ((k, v.detach()) for k, v in module.state_dict().items() if k in keys):
            want = dtype if t.is_floating_point() else t.dtype
            if leader and keep:
                self.tensors[name] = host_buffer(into, name, t.shape, want)
            layout = layout_of(t)
            if layout is None:  # not row-sharded: whole, now (a collective of the step)
                full = full_tensor(t, want)
                if leader and keep:
                    self.tensors[name].copy_(full)
                elif leader:
                    self._whole[name] = full.cpu()
                continue
            _, parts, sends = layout
            group_ranks = group_ranks or _group_ranks(t)  # type: ignore[arg-type]
            shards[name] = t.to_local()
            self._entries.append((name, tuple(t.shape), want, parts))
        self._leader, self._keep, self._bucket_bytes = leader, keep, bucket_bytes
        self._group = publish_group(group_ranks) if group_ranks is not None else None
        into = shard_sets.acquire() if shard_sets is not None else None
        self._snapshot = HostCopy(shards, dtype, into=into) if sends and self._entries else None
        if shard_sets is not None:
            shard_sets.keep(self)
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=STREAM_DEPTH)
        self._streamed = threading.Event()  # the leader's stream was read to its end (or nothing streams)
        if keep or not leader:
            self._streamed.set()
        self._thread = threading.Thread(target=self._run, name="offpolicy-publish-gather", daemon=True)

    def start(self) -> None:
        """Begin the gather (every rank of the shard group, in the same order of versions)."""
        self._thread.start()

    def released(self) -> None:
        """Block until the shards' host snapshot is complete: the weights may change from then on."""
        if self._snapshot is not None:
            self._snapshot.wait()

    @property
    def shards(self) -> dict[str, torch.Tensor] | None:
        """The host set the rank's shards are snapshotted into (None when it sends none): reusable by a
        later gather's snapshot (`ShardSets`) once this one no longer `reads` it."""
        return self._snapshot.tensors if self._snapshot is not None else None

    def reads(self) -> bool:
        """The helper thread runs: it may still read the shards' snapshot."""
        return self._thread.is_alive()

    def busy(self) -> bool:
        """Started and not finished: the gather still runs, or (the leader's stream) is not written yet."""
        return self._thread.is_alive() or (self._thread.ident is not None and not self._streamed.is_set())

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until the gather is complete (the leader's stream: written too); the leader's kept host
        tensors (empty without `keep` and on the other ranks)."""
        self._thread.join()
        self._streamed.wait()  # set at once unless this is the leader's stream (its writer reads it)
        if self._error is not None:
            raise self._error
        return self.tensors

    def stream(self) -> TensorStream:
        """The leader's tensors (without `keep`) as their buckets arrive, in the order of `entries`."""
        entries: list[Entry] = [(k, tuple(t.shape), t.dtype) for k, t in self._whole.items()]
        entries += [(name, shape, want) for name, shape, want, _ in self._entries]
        return TensorStream(entries, self._chunks())

    def _chunks(self) -> Iterator[dict[str, torch.Tensor]]:
        try:
            if self._whole:
                yield self._whole
            while (item := self._queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._streamed.set()

    # --- the helper thread

    def _run(self) -> None:
        try:
            if self._snapshot is None:
                return  # not in rank 0's shard group (HSDP), or nothing row-sharded
            local = self._snapshot.wait()  # host tensors (pinned on CUDA), their copy complete
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
        finally:
            if self._leader and not self._keep:  # the writer's stream ends (with the error, if any)
                self._queue.put(self._error if self._error is not None else _END)

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
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(parts)] if me == 0 else None
        dist.gather(flat, out, group_dst=0, group=self._group)  # host memory, gloo: no device work here
        if me != 0 or not self._leader:
            return
        self.buckets += 1
        entries = [(name, shape, want) for name, shape, want, _ in bucket]
        into = self.tensors if self._keep else {n: torch.empty(s, dtype=w) for n, s, w in entries}
        for r, part in enumerate(out):  # type: ignore[arg-type]
            unpack_rows(into, entries, parts, r, part[: sizes[r]])
        if not self._keep:
            self._queue.put(into)  # blocks while the writer is STREAM_DEPTH buckets behind
