"""Typed errors of the replay buffer: every failure a caller can act on has its own class."""

from __future__ import annotations


class BufferError(Exception):  # the package base error, named by the contract (shadows the builtin)
    """Base class of every error the buffer raises."""


class InvalidTrajectory(BufferError):
    """A group failed validation; `field` names the offending field (e.g. `trajectories[2].reward`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RateLimited(BufferError):
    """The rate limiter (samples_per_insert ratio or producer pacing) kept saying no past the wait bound."""


class BufferNotReady(BufferError):
    """Not enough eligible groups to sample (min_size_to_sample or fresh groups) within the wait bound."""


class StorageUnavailable(BufferError):
    """Redis could not be reached (or kept failing) within the retry bound."""


class BufferFull(BufferError):
    """Back-pressure: the insert would take the buffer past `max_bytes` (or Redis reached its own
    `maxmemory`). Nothing is wrong and nothing of the batch is lost: groups before the refused one are
    stored (`inserted`: their group ids), the rest are not; retry the rest, or the whole batch (inserts are
    idempotent), after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0, inserted: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.inserted = inserted


class ImagesMissing(BufferError):
    """Images asked for that the buffer does not hold (no stored group names them, and no sample consumed
    their last group within `IMAGE_GRACE_S`); `missing`: their sha256 digests."""

    def __init__(self, missing: tuple[str, ...]) -> None:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        super().__init__(f"{len(missing)} image(s) not in the buffer: {shown}")
        self.missing = missing
