"""Where a learner's ranks run: nodes, ranks per node, torchrun's rendezvous, and the command that starts it.

`offpolicy learner` takes its layout from flags or, for Kubernetes and other launchers, from the
environment (a flag wins over its variable):

    --nnodes N           OFFPOLICY_NNODES          nodes (machines) of the job (default 1)
    --node-rank R        OFFPOLICY_NODE_RANK       this node's index, 0..N-1 (default 0)
    --rdzv-endpoint H:P  OFFPOLICY_RDZV_ENDPOINT   torchrun's c10d rendezvous (needed when N > 1)
    --rdzv-id ID         OFFPOLICY_RDZV_ID         the job's rendezvous id (default offpolicy-learner)
    --nproc-per-node G   OFFPOLICY_NPROC_PER_NODE  ranks per node, one per GPU (default 1)
    --max-restarts K     OFFPOLICY_MAX_RESTARTS    times torchrun restarts the whole job (default 0)

One node runs `torchrun --standalone`; N nodes run torchrun's c10d rendezvous at the endpoint (hosted by
the agent on the endpoint's host, the others connect), so that one failed rank ends, or with
`--max-restarts`, restarts every rank on every node. c10d orders the nodes by host name and process id,
not by node rank; the learner re-numbers its ranks so that global rank = R x G + local rank
(`ranks.init_from_env`): global rank 0, the one that serves the API, `/metrics` and talks to Redis, is
always on node 0, which is what a Kubernetes Service selecting node 0's pod relies on. On several nodes
torchrun runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (`Layout.env`): each rendezvous round, a restart
included, gets a fresh TCP store (`ranks.node_store`); torchrun's default store, shared by every round,
hands restarted ranks the previous round's addresses (pytorch/pytorch#135712).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_RDZV_ID = "offpolicy-learner"
ENV = {
    "nnodes": "OFFPOLICY_NNODES",
    "node_rank": "OFFPOLICY_NODE_RANK",
    "rdzv_endpoint": "OFFPOLICY_RDZV_ENDPOINT",
    "rdzv_id": "OFFPOLICY_RDZV_ID",
    "nproc_per_node": "OFFPOLICY_NPROC_PER_NODE",
    "max_restarts": "OFFPOLICY_MAX_RESTARTS",
}
_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


class LayoutError(ValueError):
    """A launch setting that cannot work (names the flag and its variable)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The learner's nodes and ranks, as `offpolicy learner` was asked to start them."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    rdzv_endpoint: str | None = None
    rdzv_id: str = DEFAULT_RDZV_ID
    max_restarts: int = 0

    @classmethod
    def resolve(cls, given: Mapping[str, object], env: Mapping[str, str]) -> Layout:
        """Flags (`given`: None = not given) over the environment over the defaults; checked."""
        values: dict[str, object] = {}
        for name, var in ENV.items():
            value = given.get(name)
            if value is None and env.get(var, "") != "":
                value = env[var]
            if value is None:
                continue
            if name in ("rdzv_endpoint", "rdzv_id"):
                values[name] = str(value)
                continue
            try:
                values[name] = int(value)  # type: ignore[call-overload]
            except ValueError:
                raise LayoutError(f"--{_flag(name)} / {var}: {value!r} is not an integer") from None
        layout = cls(**values)  # type: ignore[arg-type]
        layout.check()
        return layout

    def check(self) -> None:
        if self.nnodes < 1:
            raise LayoutError(f"--nnodes / {ENV['nnodes']}: {self.nnodes} (at least 1)")
        if self.nproc_per_node < 1:
            raise LayoutError(
                f"--nproc-per-node / {ENV['nproc_per_node']}: {self.nproc_per_node} (at least 1)"
            )
        if self.max_restarts < 0:
            raise LayoutError(f"--max-restarts / {ENV['max_restarts']}: {self.max_restarts} (at least 0)")
        if not 0 <= self.node_rank < self.nnodes:
            raise LayoutError(
                f"--node-rank / {ENV['node_rank']}: {self.node_rank} is not in 0..{self.nnodes - 1} "
                f"(--nnodes {self.nnodes})"
            )
        if self.nnodes > 1:
            if not self.rdzv_endpoint:
                raise LayoutError(
                    f"--nnodes {self.nnodes} needs --rdzv-endpoint / {ENV['rdzv_endpoint']} (HOST:PORT of "
                    "the c10d rendezvous, e.g. node 0's address)"
                )
            if not _ENDPOINT.match(self.rdzv_endpoint):
                raise LayoutError(
                    f"--rdzv-endpoint / {ENV['rdzv_endpoint']}: {self.rdzv_endpoint!r} is not HOST:PORT"
                )
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", self.rdzv_id):
            raise LayoutError(f"--rdzv-id / {ENV['rdzv_id']}: {self.rdzv_id!r} (letters, digits, . _ -)")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def needs_torchrun(self) -> bool:
        """One rank on one node is the plain one-process learner; anything else runs under torchrun."""
        return self.world_size > 1

    def env(self) -> dict[str, str]:
        """The variables torchrun and every rank inherit: the node rank the learner numbers its ranks by;
        on several nodes a fresh TCP store per rendezvous round (`ranks.node_store`: torchrun's shared
        store breaks restarts, pytorch/pytorch#135712)."""
        out = {ENV["nnodes"]: str(self.nnodes), ENV["node_rank"]: str(self.node_rank)}
        if self.nnodes > 1:
            out["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return out

    def torchrun_argv(self, entry: list[str]) -> list[str]:
        """`python -m torch.distributed.run ... <entry>` for this layout (`entry`: `-m module args...`)."""
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        if self.nnodes == 1:
            cmd.append("--standalone")
        else:
            cmd += [
                f"--nnodes={self.nnodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}",
                f"--rdzv-id={self.rdzv_id}",
            ]
        cmd += [f"--nproc-per-node={self.nproc_per_node}", f"--max-restarts={self.max_restarts}"]
        return [*cmd, *entry]


def _flag(name: str) -> str:
    return name.replace("_", "-")
