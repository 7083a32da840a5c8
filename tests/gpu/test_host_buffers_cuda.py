"""A publish snapshot's host memory on CUDA is what the host plan counts (weights/host_buffers.py): one flat
set page-locked by cudaHostRegister at its exact size, outside torch's caching host allocator (which rounds
each pinned allocation to a power of two and keeps freed blocks: ~1.9x for Qwen2.5-7B's tensors, one
buffer each); a learner's snapshots with a writer that lags stay within the plan's `published_sets`, by
the allocator's counters and by the resident set."""

from __future__ import annotations

import threading

import pytest
import torch

from offpolicy.learner.persist.file_generation import HostCopy
from offpolicy.learner.persist.writer import BackgroundWriter, WeightsBuffers
from offpolicy.weights import host_buffers

pytestmark = pytest.mark.gpu
MIB = 2**20

# Qwen2.5-7B's tensor shapes, every dimension / 4 (one layer's seven matrices and two norms, x 7 layers, the
# embedding and head): ~0.6 GiB in bf16 with sizes just above powers of two, as the real ones are
SHAPES = {"embed": (38016, 896), "head": (38016, 896), "norm": (896,)} | {
    f"l{i}.{n}": s
    for i in range(7)
    for n, s in {
        "q": (896, 896), "k": (128, 896), "v": (128, 896), "o": (896, 896),
        "gate": (4736, 896), "up": (4736, 896), "down": (896, 4736), "n1": (896,), "n2": (896,),
    }.items()
}  # fmt: skip


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def sources() -> dict[str, torch.Tensor]:
    return {k: torch.randn(s, device="cuda") for k, s in SHAPES.items()}


def test_a_snapshot_set_is_page_locked_at_its_exact_size_outside_torchs_pinned_cache():
    src = sources()
    data = sum(t.numel() * 2 for t in src.values())
    torch.cuda.synchronize()
    stats0 = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    rss0 = rss()
    copy = HostCopy(src, torch.bfloat16).wait()
    rss1 = rss()
    assert isinstance(copy, host_buffers.HostSet) and copy.pinned
    assert all(t.is_pinned() for t in copy.values())
    assert copy.flat.nbytes == host_buffers.set_bytes({k: (s, torch.bfloat16) for k, s in SHAPES.items()})
    assert copy.flat.nbytes <= data + 64 * len(SHAPES)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == stats0  # not torch's cache
    assert rss1 - rss0 <= copy.flat.nbytes + 64 * MIB, (rss1 - rss0) / MIB
    for k, t in src.items():
        assert torch.equal(copy[k], t.to(torch.bfloat16).cpu())
    # what one pinned buffer per tensor took: the cache's rounded blocks
    per_tensor = {k: torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=True) for k, t in src.items()}
    rounded = torch.cuda.host_memory_stats()["allocated_bytes.current"] - stats0
    print(f"one set: {copy.flat.nbytes / MIB:.1f} MiB; a pinned buffer per tensor: {rounded / MIB:.1f} MiB")
    assert rounded > 1.3 * data
    del per_tensor


def test_snapshots_behind_a_lagging_writer_stay_within_the_planned_two_sets():
    src = sources()
    # plan/host.py published_sets: 2 x 2 B x P (+ each tensor's alignment)
    plan_sets = 2 * sum(t.numel() * 2 for t in src.values()) + 2 * 64 * len(SHAPES)
    writer, release = BackgroundWriter(), threading.Event()
    buffers = WeightsBuffers(writer)
    torch.cuda.synchronize()
    made0, live0, rss0 = host_buffers.made, host_buffers.live_bytes(), rss()
    stats0 = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    peak_live = 0
    for version in range(8):
        copy = HostCopy(src, torch.bfloat16, into=buffers.acquire())
        buffers.keep(copy.tensors)
        copy.wait()
        writer.submit("weights", version, lambda: release.wait(30), copy.tensors)
        peak_live = max(peak_live, host_buffers.live_bytes() - live0)
        for t in src.values():
            t.add_(1.0)  # the next step's weights
    release.set()
    writer.close(60)
    assert host_buffers.made - made0 <= 2 and peak_live <= plan_sets, (host_buffers.made - made0, peak_live)
    assert rss() - rss0 <= plan_sets + 64 * MIB, (rss() - rss0) / MIB
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == stats0
