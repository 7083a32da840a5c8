"""Host buffers for a publish snapshot: one flat allocation per snapshot, page-locked at its exact size.

torch's caching host allocator (`torch.empty(..., pin_memory=True)`) rounds every allocation up to a power
of two and keeps freed blocks cached for later pinned allocations: one pinned buffer per tensor took about
1.9x a snapshot's bytes for Qwen2.5-7B (7.1 GiB of data, 13.5 GiB allocated), and the blocks of a snapshot
no longer used stayed allocated. Here a snapshot's tensors are views into one flat host allocation (each
at a `ALIGN`-byte offset), which on CUDA is page-locked with `cudaHostRegister` at its exact size, on
whole pages of its own (`PAGE`; as torch's own DCP stager pins its copies), and unregistered when the last
reference to the set goes. A set is what the host plan counts (learner/plan/host.py `publish_snapshot`,
`published_sets`): the bytes of the tensors, no power-of-two rounding. The sets are reused from one publish
to the next (persist/writer.py `WeightsBuffers` for the full weights, persist/background_gather.py
`ShardSets` for N ranks' shard snapshots), so a run allocates each once.

A failed registration (the container's locked-memory limit, `ulimit -l`) is logged once and the set stays
pageable: copies into it are correct, only synchronous.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Mapping, Sequence

import torch

log = logging.getLogger(__name__)

ALIGN = 64
"""Every view starts at a multiple of this many bytes of the flat allocation (any dtype's alignment)."""
PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
PAGE = 4096
"""A pinned set's registered region starts on a page and spans whole pages (at most 8 KiB more than its
bytes): two registrations never share a page, which the driver would refuse as already registered."""
_warned = False
_live = 0  # bytes of this process's sets still referenced
made = 0
"""Sets allocated by this process so far (a reused set is not counted again)."""

Spec = tuple[Sequence[int], torch.dtype]


class HostSet(dict[str, torch.Tensor]):
    """Named views into one flat host allocation (`flat`); `pin`: page-locking was asked for, `pinned`:
    it is (cudaHostRegister). The registration lasts as long as the set: keep the set (not its views
    alone) while copies run."""

    flat: torch.Tensor
    pin: bool
    pinned: bool

    def fits(self, specs: Mapping[str, Spec]) -> bool:
        """Whether the set holds exactly these names, shapes and dtypes (it can be reused for them)."""
        return self.keys() == specs.keys() and all(
            tuple(self[name].shape) == tuple(shape) and self[name].dtype == dtype
            for name, (shape, dtype) in specs.items()
        )


def _offsets(specs: Mapping[str, Spec]) -> tuple[dict[str, int], int]:
    at, offsets = 0, {}
    for name, (shape, dtype) in specs.items():
        offsets[name] = at
        numel = 1
        for n in shape:
            numel *= int(n)
        at += -(-numel * dtype.itemsize // ALIGN) * ALIGN
    return offsets, at


def set_bytes(specs: Mapping[str, Spec]) -> int:
    """The bytes of the flat allocation a set of `specs` takes (its tensors' bytes, each aligned)."""
    return _offsets(specs)[1]


def _gone(nbytes: int, pinned_ptr: int | None) -> None:
    """A set's last reference went (its flat allocation is freed next): unregister it, uncount it."""
    global _live
    _live -= nbytes
    if pinned_ptr is None:
        return
    with contextlib.suppress(Exception):  # at exit, after CUDA's own teardown: nothing left to unregister
        torch.cuda.cudart().cudaHostUnregister(pinned_ptr)


def _register(flat: torch.Tensor) -> bool:
    """Page-lock `flat` (whole pages) at its size; False (logged once) when the driver refuses."""
    global _warned
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(flat.data_ptr(), flat.nbytes, PORTABLE))
    if code == 0:
        return True
    if hasattr(cudart, "cudaGetLastError"):
        cudart.cudaGetLastError()  # a refused registration must not surface at the next kernel launch
    if not _warned:
        _warned = True
        log.warning(
            "cudaHostRegister of a %.2f GiB publish snapshot failed (cudaError %d; the locked-memory limit, "
            "ulimit -l?): the snapshot's device-to-host copies run pageable, synchronously",
            flat.nbytes / 2**30, code,
        )  # fmt: skip
    return False


def host_set(specs: Mapping[str, Spec], pin: bool) -> HostSet:
    """A new set for `specs` (name -> (shape, dtype)) in one flat host allocation, page-locked at its exact
    size when `pin` (on CUDA)."""
    offsets, total = _offsets(specs)
    if pin and total > 0:  # whole pages of its own: no page shared with another registration
        pages = -(-total // PAGE) * PAGE
        raw = torch.empty(pages + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        region = raw[start : start + pages]
    else:
        raw = region = torch.empty(max(total, 1), dtype=torch.uint8)
    flat = region[:total] if total > 0 else region
    out = HostSet()
    for name, (shape, dtype) in specs.items():
        numel = 1
        for n in shape:
            numel *= int(n)
        start = offsets[name]
        out[name] = flat[start : start + numel * dtype.itemsize].view(dtype).view(tuple(shape))
    global made, _live
    made += 1
    _live += raw.nbytes
    out.flat, out.pin = flat, pin
    out.pinned = pin and total > 0 and _register(region)
    weakref.finalize(out, _gone, raw.nbytes, region.data_ptr() if out.pinned else None)
    return out


def live_bytes() -> int:
    """The bytes of every set of this process still referenced (what the host plan counts of them)."""
    return _live


def reuse_or_new(
    into: Mapping[str, torch.Tensor] | None, specs: Mapping[str, Spec], pin: bool
) -> dict[str, torch.Tensor]:
    """`into` when it is a set of exactly `specs` made with the same `pin`, else a new one."""
    if isinstance(into, HostSet) and into.pin == pin and into.fits(specs):
        return into
    return host_set(specs, pin)
