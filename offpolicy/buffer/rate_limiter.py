"""Bounded waiting for the rate limiters: exponential backoff to a deadline, and which error ends it.

The limiter decisions themselves (Reverb's MinSize and SampleToInsertRatio) run inside the insert and
sample Lua scripts, atomically with the table; `BufferConfig` validates their settings against deadlock.
This module only decides how long a refused caller waits and what it raises when the wait runs out.
"""

from __future__ import annotations

import enum
import time

from offpolicy.buffer.errors import BufferNotReady, RateLimited


class SampleStatus(enum.IntEnum):
    """The sample script's verdict (its first reply element)."""

    OK = 1
    RATE_LIMITED = 2  # samples_per_insert: samples are too far ahead of inserts
    BELOW_MIN_SIZE = 3  # min_size_to_sample not reached
    NOT_ENOUGH = 4  # fewer eligible (fresh) groups than requested
    DRAINING = 5  # more stale groups to drop than one script call drops: call again at once


class Backoff:
    """Exponential backoff up to a deadline: `delay()` is the next sleep, or None once time is up."""

    def __init__(self, timeout_s: float, initial_s: float, max_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self._next = initial_s
        self._max = max_s
        self.waits = 0

    def delay(self) -> float | None:
        """Seconds to sleep before the next attempt, capped by the deadline; None when it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        d = min(self._next, self._max, left)
        self._next = min(self._next * 2, self._max)
        self.waits += 1
        return d


def sample_refused(status: SampleStatus, num_groups: int, size: int, timeout_s: float) -> Exception:
    """The typed error for a sample whose limiter still said no when its wait ran out."""
    if status is SampleStatus.RATE_LIMITED:
        return RateLimited(
            f"sample of {num_groups} groups refused by samples_per_insert for {timeout_s:.3g} s "
            f"(samples are ahead of inserts; size={size})"
        )
    why = "below min_size_to_sample" if status is SampleStatus.BELOW_MIN_SIZE else "too few eligible groups"
    return BufferNotReady(f"sample of {num_groups} groups: {why} for {timeout_s:.3g} s (size={size})")


def check_sample_size(num_groups: int, min_diff: float, max_diff: float) -> None:
    """Refuse a sample size the ratio limiter could never allow (max_diff - min_diff < num_groups)."""
    if num_groups < 1:
        raise ValueError(f"num_groups={num_groups} must be >= 1")
    if max_diff - min_diff < num_groups:
        raise ValueError(
            f"num_groups={num_groups} > 2 * error_buffer = {max_diff - min_diff}: the samples_per_insert "
            "limiter could never allow a sample this large (deadlock); raise error_buffer"
        )
