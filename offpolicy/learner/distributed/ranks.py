"""The learner's ranks: the process group torchrun describes, and the collectives the learner uses.

One learner runs as N processes under torchrun (`offpolicy learner --nproc-per-node N`). Rank 0 (the
leader) alone talks to Redis, hosts the REST API and `/metrics`, samples the step's groups and screens
them; at every step boundary it broadcasts a `Command` (msgpack, never pickle) to the other ranks (the
followers): the step's groups as the buffer's own encoded frames, a config that takes effect at this
boundary, a checkpoint request, or stop. While it has nothing to train (paused, waiting for data, Redis
down) it broadcasts a `noop` at least every `HEARTBEAT_S`, so followers never wait on a collective for
longer than that and a config or checkpoint request still reaches them.

Every rank collates the whole batch (identical tensors everywhere: the correction, the advantages and
the loss denominators are global), then trains on its own share of the groups (distributed/split.py).
The commands are distributed/commands.py. Without torchrun (`--nproc-per-node 1`) the learner is one
plain process: no process group, no FSDP, no commands.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import torch
import torch.distributed as dist

from offpolicy.learner.distributed.nccl_net import network as nccl_network
from offpolicy.learner.distributed.nccl_net import spans_nodes

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

    NCCL on CUDA (each rank on GPU `LOCAL_RANK`; host tensors over gloo), gloo on CPU; commands and
    checkpoints use a second, gloo group so they never queue behind (or deadlock with) the training
    collectives."""
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
        world, store = int(os.environ["WORLD_SIZE"]), node_store(os.environ)
        rank = node_ordered_rank(os.environ, store)
        kwargs = {} if store is None else {"store": store}
        dist.init_process_group(
            backend_for(device_type), timeout=timeout, rank=rank, world_size=world, **kwargs
        )
    control = dist.new_group(backend="gloo", timeout=timeout)
    ranks = _current = Ranks(dist.get_rank(), dist.get_world_size(), local_rank, control)
    log.info("learner rank %d of %d (local rank %d)", ranks.rank, ranks.world_size, local_rank)
    if device_type == "cuda" and spans_nodes():
        _log_network(ranks)
    return ranks


def _log_network(ranks: Ranks) -> None:
    """A multi-node CUDA learner: what NCCL can use between the nodes (distributed/nccl_net.py), a warning
    when it is TCP sockets alone."""
    net = nccl_network()
    if net.sockets_only:
        log.warning(
            "rank %d: NCCL between nodes on %s: gradients cross the nodes 10-100x slower than over RDMA; "
            "give the pods their RDMA device or network plugin (docs/deploy.md \"NCCL on the cluster\")",
            ranks.rank, net.detail,
        )  # fmt: skip
    else:
        log.info("rank %d: NCCL between nodes can use %s (%s)", ranks.rank, net.net, net.detail)


def node_store(env: Mapping[str, str]) -> dist.Store | None:
    """Several nodes (`OFFPOLICY_NNODES` > 1): the TCP store of this rendezvous round, hosted by torchrun's
    rank 0 at `MASTER_ADDR:MASTER_PORT` (`offpolicy learner` sets `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, so
    that every round, after a restart, has a fresh store: torchrun's agent-shared store keeps the previous
    round's keys and the restarted ranks read stale addresses, pytorch/pytorch#135712). Made here because
    the learner's global ranks differ from torchrun's (`node_ordered_rank`): the store's host is torchrun's
    rank 0, which need not be the learner's. None with one node or torchrun's shared agent store."""
    if int(env.get("OFFPOLICY_NNODES", "1")) <= 1 or env.get("OFFPOLICY_NODE_RANK", "") == "":
        return None
    host = int(env["RANK"]) == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE", "False") != "True"
    return dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        int(env["WORLD_SIZE"]),
        is_master=host,
        timeout=datetime.timedelta(seconds=600),
    )


def node_ordered_rank(env: Mapping[str, str], store: dist.Store | None = None) -> int:
    """This process's global rank: torchrun's `RANK`, except on several nodes with a node rank
    (`OFFPOLICY_NODE_RANK`, set by `offpolicy learner`): node rank x ranks per node + local rank, so that
    global rank 0 (the leader) is on node 0 whatever order c10d's rendezvous put the nodes in. Every
    process claims its rank in the round's store (`node_store`) first: two nodes with one node rank fail
    at once, on every node, instead of waiting out the process group's timeout."""
    rank = int(env["RANK"])
    if (
        store is None
        or int(env.get("OFFPOLICY_NNODES", "1")) <= 1
        or env.get("OFFPOLICY_NODE_RANK", "") == ""
    ):
        return rank
    local_world, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
    wanted = int(env["OFFPOLICY_NODE_RANK"]) * local_world + int(env["LOCAL_RANK"])
    # a fresh store per round (agents' restart counts differ: one whose rank failed counts a restart, the
    # others, restarted by the membership change, do not); torchrun's shared agent store outlives the
    # rounds: one prefix per restart count there, the best it allows (restarts break there anyway)
    prefix = "offpolicy/ranks"
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        prefix += f"/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    claims = int(store.add(f"{prefix}/rank/{wanted}", 1))
    store.add(f"{prefix}/joined", 1)
    deadline = time.monotonic() + 600
    while int(store.add(f"{prefix}/joined", 0)) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {int(store.add(f'{prefix}/joined', 0))} of {world} ranks joined")
        time.sleep(0.05)
    missing = [r for r in range(world) if not store.check([f"{prefix}/rank/{r}"])]
    if claims > 1 or missing:
        raise RuntimeError(
            f"OFFPOLICY_NODE_RANK={env['OFFPOLICY_NODE_RANK']}: global rank {wanted} is claimed twice "
            f"(ranks {missing} by nobody): give every node its own node rank, 0 to "
            f"{int(env['OFFPOLICY_NNODES']) - 1}"
        )
    if wanted != rank:
        log.info(
            "torchrun rank %d is learner rank %d (node rank %s)", rank, wanted, env["OFFPOLICY_NODE_RANK"]
        )
    return wanted


def leave(code: int = 0) -> None:
    """End a rank's process once its work is done: destroy the process groups, flush, then `os._exit`.

    The interpreter's own teardown is skipped on purpose: on CPU, with gloo, a rank whose Python code
    had finished (every group destroyed) was seen aborting in the C++ static destructors that run after
    it ("terminate called without an active exception", SIGABRT, no Python frame left), about one exit in
    thirty on a loaded 2-core machine; torchrun then reports the whole run failed, its results written.
    Nothing is left to run after the groups are gone: the files are closed, the logs flushed here."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def backend_for(device_type: str) -> str:
    """The default group's backends: on CUDA NCCL for device tensors and gloo for host ones (FSDP2's CPU
    offload reduces host tensors, e.g. the gradient norm, on the default group), gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def local_device(ranks: Ranks, device: torch.device) -> torch.device:
    """The device of this rank: `cuda:<local rank>` on CUDA, `device` elsewhere."""
    if device.type == "cuda" and ranks.distributed:
        return torch.device("cuda", ranks.local_rank)
    return device


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
