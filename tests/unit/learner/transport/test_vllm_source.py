"""The broadcast transports' weight source and thread: the tensors go out on the device the backend sends
from (NCCL: this rank's GPU, even when the state is the gathered host copy of N ranks; gloo: the host), and
the transfer thread's current device is the rank's own (a new thread's is 0)."""

from __future__ import annotations

import pytest
import torch

from offpolicy.learner.transport.vllm import _weight_source, transfer_device


@pytest.mark.parametrize(
    ("backend", "local_rank", "device"),
    [
        ("nccl", 3, torch.device("cuda", 3)),
        ("nccl_m2n", 5, torch.device("cuda", 5)),
        ("gloo", 3, torch.device("cpu")),
        ("gloo_m2n", 1, torch.device("cpu")),
    ],
)
def test_each_backend_sends_from_its_device(backend, local_rank, device):
    assert transfer_device(backend, local_rank) == device


def host_state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": torch.tensor([7])}


def test_the_source_moves_host_tensors_to_the_sending_device():
    # `meta` stands for a device other than the host: the gathered host copy must not go out as it is
    sent = dict(_weight_source(host_state, torch.bfloat16, torch.device("meta")))
    assert {t.device.type for t in sent.values()} == {"meta"}
    assert sent["w"].dtype == torch.bfloat16 and sent["step"].dtype == torch.int64  # floats in publish dtype
    host = dict(_weight_source(host_state, torch.bfloat16, torch.device("cpu")))
    assert torch.equal(host["w"], host_state()["w"].to(torch.bfloat16)) and torch.equal(
        host["step"], torch.tensor([7])
    )
    meta = {
        m.name: (m.dtype, m.shape)
        for m in _weight_source(host_state, torch.bfloat16, torch.device("meta")).metadata()
    }
    assert meta == {"w": (torch.bfloat16, (2, 3)), "step": (torch.int64, (1,))}
