"""The background writer: publishes weights and writes checkpoints off the training step's critical path.

At a step boundary the loop takes a host snapshot (persist/file_generation.py, persist/single.py) and hands
it over with `submit(kind, version, write)`; training goes on while one thread writes. The rules:

- at most one write runs at a time;
- per kind (`weights`, `checkpoint`) at most one job waits; a newer job of the same kind replaces the
  waiting one (coalescing; counted), so a slow disk bounds the published version's lag instead of
  queueing unboundedly many snapshots in host memory;
- jobs run in the order they were first queued; `flush()` waits until nothing runs or waits;
- one failure never cancels another write: `submit` always queues (a failed weights write does not drop
  the same step's checkpoint, nor the reverse);
- a write that fails with an `OSError` (a full disk, an I/O error) is back-pressure, not a bug: it is
  reported (`on_failed`), and the job stays queued and is retried with capped exponential backoff per kind
  (`retry_initial_s` doubling to `retry_max_s`) until it succeeds or a newer job of its kind replaces it
  (so the newest version is written as soon as it fits; skipped versions are never half-written). A job
  made with `retry=False` (a stream that can be read once) is dropped instead. `flush()` raises such a
  spell's `WriteFailed` rather than wait for the disk;
- any other failure is a bug: re-raised in the training thread by the next `raise_if_failed()` (as
  `WriteFailed` with the cause), which ends the loop loudly.

Host memory: the weights snapshots of at most two versions (the one being written and the one waiting)
exist at once; `WeightsBuffers` reuses their sets (one flat allocation each, page-locked on CUDA:
weights/host_buffers.py) from one publish to the next.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from offpolicy.learner.errors import WriteFailed

BACK_PRESSURE_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO,
    errno.EROFS, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN,
})  # fmt: skip
"""The `OSError`s a write is retried after (a full or failing volume, a network filesystem's hiccup): they
heal when space or the volume comes back. Any other (a file where the folder should be, a permission)
is a misconfiguration, which ends the loop as a bug does."""


def back_pressure(exc: BaseException | None) -> bool:
    """`exc` is an `OSError` a write is retried after (`BACK_PRESSURE_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in BACK_PRESSURE_ERRNOS


log = logging.getLogger(__name__)

Kind = Literal["weights", "checkpoint"]
Done = Callable[[Kind, int, Any, float], None]
"""`on_done(kind, version, result, seconds)`: called on the writer thread after a job became durable."""
Failed = Callable[[Kind, int, OSError, float], None]
"""`on_failed(kind, version, error, retry_in_s)`: called on the writer thread after a write failed with an
`OSError`; `retry_in_s` = the backoff before the next try of that kind (the job retried, or a newer one)."""
RETRY_INITIAL_S, RETRY_MAX_S = 1.0, 30.0
"""Backoff between tries of a kind whose writes fail with an `OSError`: doubles from the first to the cap."""


@dataclass
class _Job:
    kind: Kind
    version: int
    write: Callable[[], Any]
    queued_at: float = field(default_factory=time.perf_counter)
    buffers: dict[str, torch.Tensor] | None = None  # the weights snapshot's host buffers, for reuse
    retry: bool = True  # False: `write` can run once (it reads a stream); a failed one is dropped


class BackgroundWriter:
    """One writer thread with a coalescing queue of at most one waiting job per kind."""

    def __init__(
        self,
        on_done: Done | None = None,
        on_failed: Failed | None = None,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self._on_done, self._on_failed = on_done, on_failed
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self._cond = threading.Condition()
        self._waiting: dict[Kind, _Job] = {}  # insertion order = run order
        self._running: _Job | None = None
        self._error: BaseException | None = None  # a bug's failure, raised once by raise_if_failed
        self._failing: dict[Kind, WriteFailed] = {}  # kinds whose last write failed with an OSError
        self._retry_at: dict[Kind, float] = {}  # kind -> monotonic time before which it is not tried
        self._closing = self._closed = False
        self.coalesced = 0  # jobs replaced by a newer one of the same kind before they ran
        self._thread = threading.Thread(target=self._loop, name="offpolicy-writer", daemon=True)
        self._thread.start()

    # --- training thread

    def submit(
        self,
        kind: Kind,
        version: int,
        write: Callable[[], Any],
        buffers: dict[str, torch.Tensor] | None = None,
        retry: bool = True,
    ) -> None:
        """Queue `write` (a closure over a host snapshot); replaces a waiting job of the same kind. Never
        raises an earlier job's failure (that is `raise_if_failed`'s): one failure cancels no other write."""
        with self._cond:
            if self._closed:
                raise WriteFailed(kind, version, RuntimeError("the writer is closed"))
            if self._waiting.pop(kind, None) is not None:
                self.coalesced += 1
            self._waiting[kind] = _Job(kind, version, write, buffers=buffers, retry=retry)
            self._cond.notify_all()

    def take_waiting_buffers(self, kind: Kind) -> dict[str, torch.Tensor] | None:
        """Withdraw the waiting job of `kind` (about to be replaced); return its buffers for reuse."""
        with self._cond:
            job = self._waiting.pop(kind, None)
            if job is None:
                return None
            self.coalesced += 1
            return job.buffers

    def busy_buffers(self) -> dict[str, torch.Tensor] | None:
        """The buffers the running job reads (never to be written into meanwhile)."""
        with self._cond:
            return self._running.buffers if self._running is not None else None

    def raise_if_failed(self) -> None:
        """Re-raise a write that failed for a bug (once) in the calling thread; an `OSError` spell is not
        raised here (see `failing`)."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def failing(self) -> dict[Kind, WriteFailed]:
        """The kinds whose last write failed with an `OSError` (cleared by the next success of that kind)."""
        with self._cond:
            return dict(self._failing)

    def pending(self, kind: Kind) -> bool:
        """Whether a job of `kind` runs or waits (a failing one waits for its retry)."""
        with self._cond:
            return kind in self._waiting or (self._running is not None and self._running.kind == kind)

    def flush(self, timeout_s: float | None = None, kind: Kind | None = None) -> bool:
        """Wait until no job (of `kind`; None = any) runs or waits; False on timeout. Re-raises a failed
        write; raises the `WriteFailed` of a job that waits for its retry after an `OSError` instead of
        waiting for the disk."""
        kinds = (kind,) if kind is not None else ("weights", "checkpoint")
        with self._cond:
            done = self._cond.wait_for(lambda: self._settled(kinds), timeout_s)
            stalled = [self._failing[k] for k in self._waiting if k in self._failing and k in kinds]
        self.raise_if_failed()
        if stalled:
            raise stalled[0]
        return done

    def _settled(self, kinds: tuple[Kind, ...]) -> bool:
        running = self._running is not None and self._running.kind in kinds
        return not running and all(k in self._failing for k in self._waiting if k in kinds)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish what is queued (a failing job is tried once more, at once, then dropped with a log
        line), then stop the thread. Re-raises a bug's failure."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._running is None and not self._waiting, timeout_s)
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self.raise_if_failed()

    # --- writer thread

    def _next(self) -> _Job | None:
        """The next job to run, waiting for one (and for a failing kind's backoff); None once closed."""
        with self._cond:
            while True:
                if self._closed and not self._waiting:
                    return None  # closed and drained
                now = time.monotonic()
                ready = [k for k in self._waiting if self._closing or self._retry_at.get(k, 0.0) <= now]
                if ready:
                    self._running = job = self._waiting.pop(ready[0])
                    return job
                waits = [self._retry_at[k] - now for k in self._waiting if k in self._retry_at]
                self._cond.wait(min(waits) if waits else None)

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            t0 = time.perf_counter()
            try:
                result = job.write()
                with self._cond:
                    self._failing.pop(job.kind, None)
                    self._retry_at.pop(job.kind, None)
                if self._on_done is not None:
                    self._on_done(job.kind, job.version, result, time.perf_counter() - t0)
            except Exception as exc:
                if back_pressure(exc):  # a full disk, an I/O error: back-pressure, retried
                    self._failed(job, exc)  # type: ignore[arg-type]
                    continue
                # a bug or a misconfiguration: re-raised in the training thread by raise_if_failed
                log.exception("background %s write of v%d failed", job.kind, job.version)
                with self._cond:
                    self._error = WriteFailed(job.kind, job.version, exc)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _failed(self, job: _Job, exc: OSError) -> None:
        """Keep `job` for a retry after the kind's backoff (unless a newer job of its kind came, the
        writer is closing, or the job cannot run twice), and report the failure."""
        with self._cond:
            tries = self._failing[job.kind].tries + 1 if job.kind in self._failing else 1
            delay = min(self.retry_initial_s * 2 ** (tries - 1), self.retry_max_s)
            failure = self._failing[job.kind] = WriteFailed(job.kind, job.version, exc)
            failure.tries = tries
            self._retry_at[job.kind] = time.monotonic() + delay
            if job.kind in self._waiting:
                self.coalesced += 1  # superseded by the newer job that waits
            elif job.retry and not self._closing:
                self._waiting[job.kind] = job
            elif self._closing:
                log.error("background %s write of v%d dropped at close: %s", job.kind, job.version, exc)
        if self._on_failed is not None:
            self._on_failed(job.kind, job.version, exc, delay)


class WeightsBuffers:
    """Chooses host buffers for a new weights snapshot: never those the writer is reading; those of a
    waiting (soon replaced) snapshot when there is one; else the spare set. At most two sets exist."""

    def __init__(self, writer: BackgroundWriter) -> None:
        self._writer = writer
        self._sets: list[dict[str, torch.Tensor]] = []

    def acquire(self) -> dict[str, torch.Tensor] | None:
        """Buffers to snapshot into (None = allocate); call `keep` with what the snapshot used."""
        waiting = self._writer.take_waiting_buffers("weights")
        if waiting is not None:
            return waiting
        busy = self._writer.busy_buffers()
        return next((s for s in self._sets if s is not busy), None)

    @property
    def sets(self) -> list[dict[str, torch.Tensor]]:
        """The sets kept for reuse (at most two)."""
        return list(self._sets)

    def keep(self, buffers: dict[str, torch.Tensor]) -> None:
        """Remember a set of buffers a snapshot was taken into (at most two are kept)."""
        if not any(s is buffers for s in self._sets):
            busy = self._writer.busy_buffers()
            self._sets = [*[s for s in self._sets if s is busy][:1], buffers]
