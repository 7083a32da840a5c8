"""A publish snapshot's host set (weights/host_buffers.py): one flat allocation of exactly its tensors' bytes
(aligned), page-locked on CUDA by cudaHostRegister at that size and unregistered when the set goes; reused
by a later snapshot of the same tensors. The registration runs here against a recording stand-in for
torch's cudart bindings (tests/gpu/test_host_buffers_cuda.py runs the real ones)."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from offpolicy.learner.persist.file_generation import HostCopy
from offpolicy.weights import host_buffers
from offpolicy.weights.host_buffers import (
    ALIGN,
    HostSet,
    host_set,
    live_bytes,
    reuse_or_new,
    set_bytes,
)

SPECS = {
    "embed": ((3, 5), torch.bfloat16),
    "norm": ((7,), torch.float32),
    "ids": ((2, 2), torch.int64),
    "empty": ((0, 4), torch.bfloat16),
}


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; answers `code` to registrations."""

    def __init__(self, code: int = 0) -> None:
        self.code, self.registered, self.unregistered, self.cleared = code, [], [], 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(host_buffers, "_warned", False)
    return fake


def test_a_set_is_one_flat_allocation_of_exactly_its_tensors_aligned_bytes():
    gc.collect()
    before = live_bytes()
    made = host_buffers.made
    s = host_set(SPECS, pin=False)
    expected = sum(
        -(-(torch.Size(shape).numel() * dtype.itemsize) // ALIGN) * ALIGN for shape, dtype in SPECS.values()
    )
    assert expected == 3 * ALIGN  # 30, 28 and 32 bytes, each aligned; the empty one takes none
    assert s.flat.nbytes == set_bytes(SPECS) == expected and live_bytes() - before == expected
    assert host_buffers.made == made + 1 and not s.pinned
    base = s.flat.data_ptr()
    for name, (shape, dtype) in SPECS.items():
        t = s[name]
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
        assert t.untyped_storage().data_ptr() == base and (t.data_ptr() - base) % ALIGN == 0
    for i, name in enumerate(SPECS):
        s[name].fill_(i + 1)
    for i, name in enumerate(SPECS):  # no view overlaps another
        assert bool((s[name] == i + 1).all())
    assert s.fits(SPECS) and not s.fits({**SPECS, "norm": ((8,), torch.float32)})
    assert not s.fits({k: v for k, v in SPECS.items() if k != "ids"})
    del s
    gc.collect()
    assert live_bytes() == before


def test_on_cuda_a_set_is_registered_on_whole_pages_of_its_own_once_and_unregistered_when_it_goes(cudart):
    s = host_set(SPECS, pin=True)
    pages = -(-set_bytes(SPECS) // host_buffers.PAGE) * host_buffers.PAGE  # whole pages of its own
    assert s.pinned and cudart.registered == [(s.flat.data_ptr(), pages, host_buffers.PORTABLE)]
    assert s.flat.data_ptr() % host_buffers.PAGE == 0 and s.flat.nbytes == set_bytes(SPECS)
    assert reuse_or_new(s, SPECS, pin=True) is s  # the next snapshot of the same tensors: no new allocation
    assert len(cudart.registered) == 1
    other = reuse_or_new(s, {**SPECS, "norm": ((8,), torch.float32)}, pin=True)  # the tensors changed
    assert other is not s and len(cudart.registered) == 2
    assert reuse_or_new(s, SPECS, pin=False) is not s  # a pageable set is asked for: not this one
    ptr = s.flat.data_ptr()
    del s
    gc.collect()
    assert cudart.unregistered == [ptr]  # before its memory is freed: the set holds the allocation


def test_a_refused_registration_leaves_the_set_pageable_says_so_once_and_clears_the_error(cudart, caplog):
    cudart.code = 2  # cudaErrorMemoryAllocation: the locked-memory limit
    with caplog.at_level(logging.WARNING, logger=host_buffers.__name__):
        first, second = host_set(SPECS, pin=True), host_set(SPECS, pin=True)
    assert not first.pinned and not second.pinned and cudart.cleared == 2
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "cudaHostRegister" in caplog.records[0].message and len(caplog.records) == 1
    assert reuse_or_new(first, SPECS, pin=True) is first  # not asked again at every publish
    del first, second
    gc.collect()
    assert cudart.unregistered == []


def test_host_copy_snapshots_into_one_set_and_the_next_snapshot_reuses_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    sources = dict(model.state_dict())
    first = HostCopy(sources, torch.bfloat16, pin=False).wait()
    assert isinstance(first, HostSet)
    assert len({t.untyped_storage().data_ptr() for t in first.values()}) == 1
    for name, t in sources.items():
        assert torch.equal(first[name], t.to(torch.bfloat16))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    made = host_buffers.made
    second = HostCopy(dict(model.state_dict()), torch.bfloat16, into=first, pin=False).wait()
    assert second is first and host_buffers.made == made
    assert torch.equal(second["0.weight"], model[0].weight.to(torch.bfloat16))
    third = HostCopy(dict(model.state_dict()), None, into=first, pin=False).wait()  # fp32: not these
    assert third is not first and third["0.weight"].dtype == torch.float32
