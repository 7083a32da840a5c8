"""The learner's ranks: the process group, the commands rank 0 sends every other rank, the data split.

One learner runs as N processes under torchrun (`offpolicy learner --nproc-per-node N`). Rank 0 (the
leader) alone talks to Redis, hosts the REST API and `/metrics`, samples the step's groups and screens
them; at every step boundary it broadcasts a `Command` (msgpack, never pickle) to the other ranks (the
followers): the step's groups as the buffer's own encoded frames, a config that takes effect at this
boundary, a checkpoint request, or stop. While it has nothing to train (paused, waiting for data, Redis
down) it broadcasts a `noop` at least every `HEARTBEAT_S`, so followers never wait on a collective for
longer than that and a config or checkpoint request still reaches them.

Every rank collates the whole batch (identical tensors everywhere: the correction, the advantages and
the loss denominators are global), then trains on its own share of the groups: `assign_groups` balances
token counts, a group is never split. Without torchrun (`--nproc-per-node 1`) the learner is one plain
process: no process group, no FSDP, no commands.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""A leader with nothing to train broadcasts a `noop` at least this often."""
COLLECTIVE_TIMEOUT_S = 1800.0
"""A collective that waits longer than this raises (a rank died without torchrun noticing): never a hang."""


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place in the learner: rank, world size, local rank, the control group (gloo)."""

    rank: int
    world_size: int
    local_rank: int
    control: dist.ProcessGroup | None = None  # CPU group for commands and checkpoint collectives

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Joined a process group (torchrun): FSDP2, commands, sharded checkpoints, even on one rank."""
        return self.control is not None


SINGLE = Ranks(rank=0, world_size=1, local_rank=0)
_current = SINGLE


def current() -> Ranks:
    """The ranks `init_from_env` joined in this process (`SINGLE` before, or without torchrun)."""
    return _current


def init_from_env(device_type: str) -> Ranks:
    """Join the process group torchrun describes in the environment (also with one rank: FSDP2 on one
    GPU); `SINGLE` without torchrun (the one-process learner, no FSDP).

    NCCL on CUDA (each rank on GPU `LOCAL_RANK`), gloo on CPU; commands and checkpoints use a second,
    gloo group so they never queue behind (or deadlock with) the training collectives."""
    global _current
    if "LOCAL_RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # not started by torchrun
        return SINGLE
    if _current.distributed:
        return _current
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    ranks = _current = Ranks(dist.get_rank(), dist.get_world_size(), local_rank, control)
    log.info("learner rank %d of %d (local rank %d)", ranks.rank, ranks.world_size, local_rank)
    return ranks


def local_device(ranks: Ranks, device: torch.device) -> torch.device:
    """The device of this rank: `cuda:<local rank>` on CUDA, `device` elsewhere."""
    if device.type == "cuda" and ranks.distributed:
        return torch.device("cuda", ranks.local_rank)
    return device


# --- commands


@dataclass(frozen=True, slots=True)
class Command:
    """What every rank does at this step boundary, in this order: apply `config` (a LearnerConfig as
    JSON, with its `config_version`), train on `groups` (encoded frames) when `op == "step"`, then
    checkpoint when `checkpoint`; `op == "stop"` ends the followers."""

    op: str  # "step" | "noop" | "stop"
    groups: list[bytes] = field(default_factory=list)
    config: str | None = None
    config_version: int = 0
    checkpoint: bool = False

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "op": self.op,
                "groups": self.groups,
                "config": self.config,
                "config_version": self.config_version,
                "checkpoint": self.checkpoint,
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> Command:
        doc = msgpack.unpackb(data, raw=False)
        return cls(
            op=str(doc["op"]),
            groups=list(doc["groups"]),
            config=doc["config"],
            config_version=int(doc["config_version"]),
            checkpoint=bool(doc["checkpoint"]),
        )


def broadcast_command(ranks: Ranks, command: Command | None) -> Command:
    """Leader: send `command` to every rank (and return it). Follower: pass None, get the leader's."""
    if not ranks.distributed:
        assert command is not None
        return command
    data = command.encode() if ranks.is_leader and command is not None else b""
    size = torch.tensor([len(data)], dtype=torch.long)
    dist.broadcast(size, src=0, group=ranks.control)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if ranks.is_leader
        else torch.empty(int(size), dtype=torch.uint8)
    )
    if int(size):
        dist.broadcast(buf, src=0, group=ranks.control)
    return command if ranks.is_leader and command is not None else Command.decode(buf.numpy().tobytes())


# --- the data split


def assign_groups(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Group indices per rank, balanced by token count (largest first onto the lightest rank; ties by
    rank), each rank's list in ascending order. Deterministic: every rank computes the same split."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for g in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        out[r].append(g)
        loads[r] += token_counts[g]
    return [sorted(x) for x in out]


def shares(
    rows: torch.Tensor, group_index: torch.Tensor, row_tokens: torch.Tensor, world_size: int
) -> list[torch.Tensor]:
    """Split the (global) row indices `rows` over the ranks: whole groups (`group_index` (B,) maps rows to
    groups), balanced by the groups' token counts (`row_tokens` (B,)). Every rank holds the same batch, so
    every rank computes the same split (and so knows how many micro-batches the others run)."""
    if world_size == 1:
        return [rows]
    groups, tokens = group_index[rows].tolist(), row_tokens[rows].tolist()
    ids = sorted(set(groups))
    per_group = dict.fromkeys(ids, 0)
    for g, t in zip(groups, tokens, strict=True):
        per_group[g] += int(t)
    out = []
    for picked in assign_groups([per_group[g] for g in ids], world_size):
        mine = {ids[i] for i in picked}
        out.append(rows[[i for i, g in enumerate(groups) if g in mine]])
    return out


def barrier(ranks: Ranks) -> None:
    """Every rank waits for the others (control group: CPU, whatever the training backend)."""
    if ranks.distributed:
        dist.barrier(group=ranks.control)


def all_reduce_sum(ranks: Ranks, tensor: torch.Tensor) -> torch.Tensor:
    """Sum of `tensor` over the ranks (in place; returned). A no-op on one process."""
    if ranks.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_bytes(ranks: Ranks, data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order (control group)."""
    if not ranks.distributed:
        return [data]
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(ranks.world_size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.long), group=ranks.control)
    width = max(1, max(int(n) for n in sizes))
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(width, dtype=torch.uint8) for _ in range(ranks.world_size)]
    dist.all_gather(parts, mine, group=ranks.control)
    return [p.numpy().tobytes()[: int(n)] for p, n in zip(parts, sizes, strict=True)]


def reduce_means(ranks: Ranks, sums: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Metrics as (sum, count) per rank -> the mean over every rank's values (keys may differ by rank: a
    rank whose share of a mini-batch was empty took no values)."""
    total: dict[str, list[float]] = {}
    for blob in all_gather_bytes(ranks, msgpack.packb(sums)):
        for k, (s, n) in msgpack.unpackb(blob, raw=False).items():
            acc = total.setdefault(k, [0.0, 0])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
    return {k: s / n for k, (s, n) in total.items() if n}
