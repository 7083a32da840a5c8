"""The learner's publish path (`publish.transport`): which versions become file generations, what reaches the
transport, what the metrics count; and the gloo engine's bucket cut against vLLM's own packing."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from offpolicy.actors.config import ReloadConfig
from offpolicy.learner.config.publish import PublishConfig
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.transport.base import TransferResult
from offpolicy.learner.transport.publisher import Publisher, TransferMetrics
from offpolicy.weights.config import TransferConfig
from offpolicy.weights.engines.gloo import buckets


class Files:
    def __init__(self) -> None:
        self.written: list[int] = []

    def publish(self, version: int, gather=None) -> None:
        self.written.append(version)


class Sent:
    name = "fake"

    def __init__(self, fail_on: set[int] = frozenset(), stuck_on: set[int] = frozenset()) -> None:
        self.sent: list[int] = []
        self.fail_on, self.stuck_on = fail_on, stuck_on
        self.stuck, self.busy = 0, False

    def send(self, version: int) -> TransferResult:
        self.sent.append(version)
        ok = version not in self.fail_on
        if version in self.stuck_on:  # its group's teardown outlived the bound: still closing
            self.stuck, self.busy = self.stuck + 1, True
        return TransferResult(version, 0.2, 1000 if ok else 0, 2, ok, "" if ok else "dead peer")

    def close(self) -> None:
        pass


class Cfg:
    def __init__(self, **publish) -> None:
        self.publish = PublishConfig(**publish)


def test_files_transport_writes_every_version():
    files = Files()
    pub = Publisher(Cfg(transport="files", persist_every=3), files, None, None)
    for v in range(1, 6):
        pub.publish(v, None)
    assert files.written == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(("every", "expected"), [(3, [1, 4, 7]), (2, [1, 3, 5, 7])])
def test_vllm_transport_sends_every_version_and_persists_every_nth(every, expected):
    files, sent = Files(), Sent()
    metrics = TransferMetrics(CollectorRegistry())
    pub = Publisher(Cfg(transport="vllm", persist_every=every), files, sent, metrics)
    for v in range(1, 8):
        pub.publish(v, None)
    assert sent.sent == list(range(1, 8))
    assert files.written == expected
    pub.at_checkpoint(7, None)  # already a file generation: not written twice
    pub.at_checkpoint(8, None)
    assert files.written == [*expected, 8]


def test_metrics_count_transfers_bytes_group_and_failures():
    reg = CollectorRegistry()
    pub = Publisher(Cfg(transport="vllm"), Files(), Sent(fail_on={2}), TransferMetrics(reg))
    for v in (1, 2, 3):
        pub.publish(v, None)
    val = reg.get_sample_value
    assert val("offpolicy_learner_transfers_total") == 2
    assert val("offpolicy_learner_transfer_failures_total") == 1
    assert val("offpolicy_learner_transfer_bytes_total") == 2000
    assert val("offpolicy_learner_transfer_group_size") == 2
    assert val("offpolicy_learner_transfer_version") == 3
    assert pub.last is not None and pub.last.version == 3


def test_a_stuck_teardown_is_counted_once_and_shown_in_the_status():
    reg = CollectorRegistry()
    sent = Sent(fail_on={2}, stuck_on={2})
    stuck = LearnerMetrics(reg).transfer_stuck  # declared whatever the transport: the alert's series
    pub = Publisher(Cfg(transport="vllm"), Files(), sent, TransferMetrics(reg), stuck=stuck)
    assert pub.status() == {
        "last_version": None, "ok": None, "error": None, "group_size": 0, "unwinding": False, "stuck": 0
    }  # fmt: skip
    for v in (1, 2):
        pub.publish(v, None)
    assert pub.status() == {
        "last_version": 2, "ok": False, "error": "dead peer", "group_size": 2, "unwinding": True, "stuck": 1
    }  # fmt: skip
    sent.busy = False  # it ended
    pub.publish(3, None)
    assert reg.get_sample_value("offpolicy_learner_transfer_stuck_total") == 1
    assert pub.status()["unwinding"] is False and pub.status()["ok"] is True
    assert Publisher(Cfg(transport="files"), Files(), None, None).status() is None


def test_files_checkpoint_writes_nothing_extra():
    files = Files()
    Publisher(Cfg(transport="files"), files, None, None).at_checkpoint(4, None)
    assert files.written == []


def test_backends_vllm_has_but_the_learner_does_not_drive_are_config_errors():
    with pytest.raises(ValidationError, match="does not drive it yet"):
        TransferConfig(backend="sparse_nccl")
    assert TransferConfig(backend="nccl_m2n").sharded and TransferConfig(backend="gloo_m2n").sharded
    assert not TransferConfig(backend="nccl").sharded
    with pytest.raises(ValidationError, match="backend"):
        TransferConfig(backend="tcp")
    assert TransferConfig(backend="gloo").backend == "gloo"


def test_receiving_by_transfer_needs_the_in_place_pause():
    with pytest.raises(ValidationError, match=r"reload\.mode must be inflight"):
        ReloadConfig(transport="vllm", mode="drain")
    assert ReloadConfig(transport="vllm", mode="inflight").transport == "vllm"


@pytest.mark.parametrize("bucket", [4096, 10_000, 1 << 20])
def test_gloo_buckets_cut_the_stream_where_vllms_packing_does(bucket):
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    g = torch.Generator().manual_seed(0)
    tensors = [torch.zeros(int(n), dtype=torch.float32) for n in torch.randint(1, 900, (40,), generator=g)]
    pairs = iter([(str(i), t) for i, t in enumerate(tensors)])
    packed = []
    while (chunk := pack_tensors(pairs, lambda item: item[1], bucket)) is not None:
        packed.append(chunk.packed_tensor.numel())
    sizes = [t.numel() * 4 for t in tensors]
    ours = [sum(sizes[a:b]) for a, b in buckets(sizes, bucket)]
    assert ours == packed
