"""Which network NCCL can use between this node and the others, read from the node at start.

NCCL picks its network itself and says which only under `NCCL_DEBUG=INFO` (`NET/IB`, `NET/Socket`,
`NET/OFI`...); with the default `WARN` a learner whose ranks span nodes without RDMA falls back to TCP
sockets silently, and its gradient reduce-scatters run 10-100x slower. At start every rank of a
multi-node CUDA learner logs what this node offers (`network`), a warning when it is sockets only, and the
leader exports it (`offpolicy_learner_nccl_net_info{net}`):

- `plugin:<name>`: `NCCL_NET_PLUGIN` or `NCCL_NET` names a network plugin (AWS EFA's aws-ofi-nccl, GCP's
  TCPX / TCPXO): NCCL loads it first;
- `ib`: RDMA devices (InfiniBand or RoCE) in `/sys/class/infiniband`, not disabled by `NCCL_IB_DISABLE=1`:
  the pod was given its RDMA device (docs/deploy.md "NCCL on the cluster");
- `socket`: neither: TCP over `NCCL_SOCKET_IFNAME` (or the default interface).

It is what the node offers, not NCCL's choice (a plugin can fail to load, an RDMA device can be down): set
`NCCL_DEBUG=INFO` for that.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

IB_DEVICES = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class NcclNetwork:
    """What NCCL can use between nodes here: `net` (`plugin:<name>`, `ib` or `socket`) and a detail line."""

    net: str
    detail: str

    @property
    def sockets_only(self) -> bool:
        return self.net == "socket"


def spans_nodes(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the ranks span several nodes (`OFFPOLICY_NNODES` > 1: `offpolicy learner --nnodes`)."""
    return int(env.get("OFFPOLICY_NNODES", "1") or "1") > 1


def network(env: Mapping[str, str] = os.environ, ib_devices: Path = IB_DEVICES) -> NcclNetwork:
    """This node's network for NCCL (see the module docstring)."""
    plugin = env.get("NCCL_NET_PLUGIN") or env.get("NCCL_NET")
    if plugin and plugin.lower() not in ("socket", "ib", "none"):
        return NcclNetwork(f"plugin:{plugin}", f"network plugin {plugin!r} (NCCL_NET_PLUGIN / NCCL_NET)")
    devices = sorted(p.name for p in ib_devices.iterdir()) if ib_devices.is_dir() else []
    if (plugin or "").lower() != "socket" and devices and env.get("NCCL_IB_DISABLE", "0") != "1":
        return NcclNetwork("ib", f"RDMA devices {', '.join(devices)}")
    why = "NCCL_IB_DISABLE=1" if devices else f"no RDMA device in {ib_devices}"
    if (plugin or "").lower() == "socket":
        why = "NCCL_NET=Socket"
    iface = env.get("NCCL_SOCKET_IFNAME", "the default interface")
    return NcclNetwork("socket", f"TCP sockets over {iface} ({why})")
