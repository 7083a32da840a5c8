"""The transfer group's settings, shared by the learner (`publish.transfer`) and the actors
(`reload.transfer`); used when `publish.transport` / `reload.transport` is `vllm`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from config.base import ConfigModel


class TransferConfig(ConfigModel):
    """vLLM's weight-transfer engine between the learner (rank 0) and the actors' inference workers."""

    backend: Literal["nccl", "gloo", "nccl_m2n", "sparse_nccl"] = "nccl"
    """vLLM's weight-transfer backend (the name in vLLM's factory): `nccl` (GPUs; dense broadcast in packed
    buckets; the learner and every actor must reach each other over a network NCCL can use) or `gloo` (CPU;
    the project's test transport, actors/transport/gloo_engine.py). `nccl_m2n` (resharding straight from
    FSDP shards) and `sparse_nccl` (deltas) are vLLM's too, but the learner does not drive them yet: naming
    them is a config error. Learner and actors must name the same one."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Bound on every wait of one transfer: forming the group, the broadcast (a dead peer fails it), the
    actors' answers. The learner's step never waits longer for the actors."""
    heartbeat_s: float = Field(2.0, gt=0.0)
    """Actor: seconds between membership heartbeats in Redis; a member is gone after 3 missed ones."""
    address: str = Field("127.0.0.1", max_length=253)
    """Learner: the address of the learner that the actors' workers connect to (its pod IP or service
    name on Kubernetes, its service name on compose)."""
    port: int = Field(0, ge=0, le=65535)
    """Learner: the TCP port of the group's rendezvous store (0 = a free port, chosen per group)."""
    bucket_bytes: int = Field(512 << 20, ge=1 << 20)
    """Size of the packed buckets the weights are broadcast in (vLLM's `packed_buffer_size_bytes`)."""

    @field_validator("backend")
    @classmethod
    def _driven(cls, v: str) -> str:
        if v in ("nccl_m2n", "sparse_nccl"):
            raise ValueError(
                f"{v!r} is vLLM's, but the learner does not drive it yet "
                "(nccl_m2n needs every FSDP rank in the group, sparse_nccl per-round deltas); "
                "use nccl or gloo"
            )
        return v
