"""The background writer: publishes weights and writes checkpoints off the training step's critical path.

At a step boundary the loop takes a host snapshot (persist/weights.py, persist/single.py) and hands it
over with `submit(kind, version, write)`; training goes on while one thread writes. The rules:

- at most one write runs at a time;
- per kind (`weights`, `checkpoint`) at most one job waits; a newer job of the same kind replaces the
  waiting one (coalescing; counted), so a slow disk bounds the published version's lag instead of
  queueing unboundedly many snapshots in host memory;
- jobs run in the order they were first queued; `flush()` waits until nothing runs or waits;
- a write that fails is re-raised in the training thread by the next `raise_if_failed()` (as `WriteFailed`
  with the cause), so a broken disk ends the loop loudly instead of silently freezing the published version.

Host memory: the weights snapshots of at most two versions (the one being written and the one waiting)
exist at once; `WeightsBuffers` reuses their (pinned, on CUDA) buffers from one publish to the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from offpolicy.learner.errors import WriteFailed

log = logging.getLogger(__name__)

Kind = Literal["weights", "checkpoint"]
Done = Callable[[Kind, int, Any, float], None]
"""`on_done(kind, version, result, seconds)`: called on the writer thread after a job became durable."""


@dataclass
class _Job:
    kind: Kind
    version: int
    write: Callable[[], Any]
    queued_at: float = field(default_factory=time.perf_counter)
    buffers: dict[str, torch.Tensor] | None = None  # the weights snapshot's host buffers, for reuse


class BackgroundWriter:
    """One writer thread with a coalescing queue of at most one waiting job per kind."""

    def __init__(self, on_done: Done | None = None) -> None:
        self._on_done = on_done
        self._cond = threading.Condition()
        self._waiting: dict[Kind, _Job] = {}  # insertion order = run order
        self._running: _Job | None = None
        self._error: BaseException | None = None
        self._closed = False
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
    ) -> None:
        """Queue `write` (a closure over a host snapshot); replaces a waiting job of the same kind."""
        self.raise_if_failed()
        with self._cond:
            if self._closed:
                raise WriteFailed(kind, version, RuntimeError("the writer is closed"))
            if self._waiting.pop(kind, None) is not None:
                self.coalesced += 1
            self._waiting[kind] = _Job(kind, version, write, buffers=buffers)
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
        """Re-raise a failed write (once) in the calling thread."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until no job runs or waits; False on timeout. Re-raises a failed write."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._running is None and not self._waiting, timeout_s)
        self.raise_if_failed()
        return done

    def close(self, timeout_s: float | None = None) -> None:
        """Finish what is queued, then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # --- writer thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting or self._closed)
                if not self._waiting:
                    return  # closed and drained
                kind = next(iter(self._waiting))
                self._running = job = self._waiting.pop(kind)
            t0 = time.perf_counter()
            try:
                result = job.write()
                if self._on_done is not None:
                    self._on_done(job.kind, job.version, result, time.perf_counter() - t0)
            except Exception as exc:  # translated: re-raised in the training thread by raise_if_failed
                log.exception("background %s write of v%d failed", job.kind, job.version)
                with self._cond:
                    self._error = WriteFailed(job.kind, job.version, exc)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()


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

    def keep(self, buffers: dict[str, torch.Tensor]) -> None:
        """Remember a set of buffers a snapshot was taken into (at most two are kept)."""
        if not any(s is buffers for s in self._sets):
            busy = self._writer.busy_buffers()
            self._sets = [*[s for s in self._sets if s is busy][:1], buffers]
