"""The transfer group's settings, shared by the learner (`publish.transfer`) and the actors
(`reload.transfer`); used when `publish.transport` / `reload.transport` is `vllm`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from offpolicy.config.base import MAX_BYTES, MAX_WAIT_S, ConfigModel


class TransferConfig(ConfigModel):
    """vLLM's weight-transfer engine between the learner (rank 0) and the actors' inference workers."""

    backend: Literal["nccl", "gloo", "nccl_m2n", "gloo_m2n", "sparse_nccl"] = "nccl"
    """vLLM's weight-transfer backend (the name in vLLM's factory). Broadcast from the learner's rank 0,
    which gathers the full weights first on N ranks: `nccl` (GPUs, packed buckets; the learner and every
    actor must reach each other over a network NCCL can use) or `gloo` (CPU; the project's test transport,
    weights/engines/gloo.py). From every learner rank's own FSDP shards, no gather: `nccl_m2n`
    (GPUs; vLLM's engine over NCCL's m2n reshard, which needs the `nccl.m2n` package on both sides) or
    `gloo_m2n` (CPU; its test stand-in, weights/engines/gloo_m2n.py); every learner rank then joins the
    group and must reach the actors. `sparse_nccl` (deltas) is vLLM's too, but the learner does not drive
    it yet: naming it is a config error. Learner and actors must name the same one."""
    timeout_s: float = Field(60.0, gt=0.0, le=MAX_WAIT_S)
    """Bound on every wait of one transfer: forming the group, the broadcast (a dead peer fails it), the
    actors' answers. The learner's step never waits longer for the actors."""
    heartbeat_s: float = Field(2.0, gt=0.0, le=MAX_WAIT_S)
    """Actor: seconds between membership heartbeats in Redis; a member is gone after 3 missed ones."""
    address: str = Field("127.0.0.1", max_length=253)
    """Learner: the address of the learner that the actors' workers connect to. vLLM's rank 0 (the
    learner) binds its rendezvous store to it, so it must be an address of the learner's own host: its pod
    IP (or a headless Service's name) on Kubernetes, never a ClusterIP Service's name; its service name on
    compose. Checked when the learner starts. With an m2n backend every learner rank connects to it too
    (rank 0's node)."""
    port: int = Field(0, ge=0, le=65535)
    """Learner: the TCP port of the group's rendezvous store (0 = a free port, chosen per group)."""
    bucket_bytes: int = Field(512 << 20, ge=1 << 20, le=MAX_BYTES)
    """Size of the packed buckets the weights are broadcast in (vLLM's `packed_buffer_size_bytes`)."""

    @field_validator("backend")
    @classmethod
    def _driven(cls, v: str) -> str:
        if v == "sparse_nccl":
            raise ValueError(
                f"{v!r} is vLLM's, but the learner does not drive it yet (it sends per-round deltas "
                "against the previous version every member must hold); use nccl or nccl_m2n"
            )
        return v

    @property
    def sharded(self) -> bool:
        """Every learner rank sends its own shards (the m2n backends); else rank 0 sends gathered weights."""
        return self.backend.endswith("_m2n")
