"""The broadcast transport on a GPU: the transfer thread's current device is the rank's, and the weight
source yields the (host) state on that device, as vLLM's NCCL communicator requires."""

from __future__ import annotations

import threading

import pytest
import torch

from offpolicy.learner.transport.vllm import _weight_source, bind_thread, transfer_device
from tests.unit.learner.transport.test_vllm_source import host_state

pytestmark = pytest.mark.gpu


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_the_transfer_thread_sends_from_the_ranks_device():
    pytest.importorskip("vllm", reason="the weight source is vLLM's (the learner image has vLLM)")
    device = transfer_device("nccl", torch.cuda.device_count() - 1)
    seen: dict[str, object] = {}

    def run() -> None:
        bind_thread(device)
        seen["current"] = torch.cuda.current_device()
        seen["devices"] = {t.device for _, t in _weight_source(host_state, torch.bfloat16, device)}

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == {"current": device.index, "devices": {device}}
