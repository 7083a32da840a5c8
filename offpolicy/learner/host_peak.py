"""A process's peak host memory over a stretch of code (the learner's start-up), from the kernel's counters.

`PeakHostMemory` resets the kernel's high-water mark of this process's resident set (`VmHWM`, by writing
5 to /proc/self/clear_refs, Linux 4.0+) on entry and reads it on exit: `peak_bytes` is the largest
resident set seen in between, `added_bytes` that peak minus the resident set at entry. Without
/proc/self/clear_refs it falls back to `getrusage`'s `ru_maxrss`, which cannot be reset (the peak since
the process started: an upper bound).
"""

from __future__ import annotations

import resource
from pathlib import Path
from types import TracebackType

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakHostMemory:
    """`with PeakHostMemory() as m: ...` then `m.added_bytes`, `m.peak_bytes`, `m.base_bytes`."""

    def __init__(self) -> None:
        self.base_bytes = 0
        self.peak_bytes = 0
        self.exact = False  # the high-water mark was reset at entry (else: ru_maxrss, an upper bound)

    def __enter__(self) -> PeakHostMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.exact = _status_kib("VmHWM") is not None
        except OSError:
            self.exact = False
        self.base_bytes = (_status_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        hwm = _status_kib("VmHWM") if self.exact else None
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        self.peak_bytes = hwm * 1024

    @property
    def added_bytes(self) -> int:
        return max(0, self.peak_bytes - self.base_bytes)
