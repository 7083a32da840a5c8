"""What NCCL can use between nodes, read from the node (learner/distributed/nccl_net.py): a network plugin
first, then RDMA devices not disabled, else TCP sockets (what a multi-node learner warns about)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from offpolicy.learner.distributed import nccl_net, ranks


@pytest.fixture
def hcas(tmp_path):
    root = tmp_path / "infiniband"
    root.mkdir()
    for name in ("mlx5_1", "mlx5_0"):
        (root / name).mkdir()
    return root


def test_a_plugin_then_rdma_devices_then_sockets(hcas, tmp_path):
    none = tmp_path / "absent"
    assert nccl_net.network({"NCCL_NET_PLUGIN": "aws-ofi"}, hcas).net == "plugin:aws-ofi"
    rdma = nccl_net.network({}, hcas)
    assert (rdma.net, rdma.detail, rdma.sockets_only) == ("ib", "RDMA devices mlx5_0, mlx5_1", False)
    disabled = nccl_net.network({"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}, hcas)
    assert disabled.sockets_only and disabled.detail == "TCP sockets over eth0 (NCCL_IB_DISABLE=1)"
    forced = nccl_net.network({"NCCL_NET": "Socket"}, hcas)
    assert forced.sockets_only and "NCCL_NET=Socket" in forced.detail
    bare = nccl_net.network({}, none)
    assert bare.sockets_only and f"no RDMA device in {none}" in bare.detail
    assert nccl_net.spans_nodes({"OFFPOLICY_NNODES": "2"}) and not nccl_net.spans_nodes({})


def test_each_rank_of_a_multi_node_learner_warns_when_nccl_has_sockets_only(monkeypatch, caplog, tmp_path):
    rank = SimpleNamespace(rank=3)
    monkeypatch.setattr(nccl_net, "IB_DEVICES", tmp_path / "absent")
    monkeypatch.setattr(ranks, "nccl_network", lambda: nccl_net.network({}, tmp_path / "absent"))
    with caplog.at_level(logging.INFO, logger=ranks.__name__):
        ranks._log_network(rank)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "rank 3: NCCL between nodes on TCP sockets" in record.message
