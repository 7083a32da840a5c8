"""Host a domain loop (`run(stop_event)`) in a background thread of a service process, stopped by handle,
and the contract for a loop that dies: `/healthz` 503 at once, the process exits non-zero after a grace.

A domain loop handles its own transient trouble (the learner retries an unreachable Redis for as long as
it lasts and says so, which `/readyz` reports); an exception that leaves `run` is not transient. Then
`BackgroundLoop` keeps it (`failure()` for `/healthz`, `/readyz` and `/v1/status`) and calls its
`on_failure` hook: `ExitAfterGrace`, which asks the server to stop after `fatal_exit_grace_s` so that the
process exits with `EXIT_LOOP_FAILED` and compose or Kubernetes restarts it. The grace leaves time to
read the reason from `/v1/status` and the log, and to scrape the last metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

EXIT_LOOP_FAILED = 70
"""Process exit status after a hosted loop died (EX_SOFTWARE): not 0, so a restart policy restarts it."""

FailureHook = Callable[[BaseException], None]
"""Called once, from the loop's thread, with the exception that ended the loop."""


class BackgroundLoop:
    """Runs `target(stop_event)` in a daemon thread; `stop()` sets the event and joins with a bound.

    If the loop raises, the exception is logged, kept in `error` (`failure()` describes it) and handed to
    `on_failure`; the service keeps serving its status and metrics until that hook ends the process.
    """

    def __init__(
        self, target: Callable[[threading.Event], object], name: str, on_failure: FailureHook | None = None
    ) -> None:
        self._target = target
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        try:
            self._target(self._stop)
        except Exception as exc:  # translated: handed to the hook, kept for /healthz and /v1/status, logged
            if self._on_failure is not None:
                self._on_failure(exc)  # first: once /healthz sees the error, the exit is already scheduled
            self.error = exc
            log.exception("%s loop stopped with an error", self._thread.name)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """Ask the loop to stop at its next boundary and wait up to `timeout_s`; True if it stopped."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def failure(self) -> str | None:
        """None unless the loop raised (a loop that returned on its own, e.g. at max_steps, is fine)."""
        if self.error is not None:
            return f"{self._thread.name} loop failed: {type(self.error).__name__}: {self.error}"
        return None

    def readiness(self) -> str | None:
        """The loop's part of `/readyz`: its failure, if any."""
        return self.failure()

    def __repr__(self) -> str:
        return f"BackgroundLoop({self._thread.name!r})"


class ExitAfterGrace:
    """The `on_failure` hook of a service's loop: `request_exit(EXIT_LOOP_FAILED)` after `grace_s`.

    `request_exit` is installed by `serve_app` (it stops uvicorn, whose return makes the exit status); an
    app served in-process (tests) has none, and then the hook only logs that it would exit.
    """

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self.request_exit: Callable[[int], None] | None = None
        self._clock = clock
        self._deadline: float | None = None
        self._timer: threading.Timer | None = None

    def __call__(self, error: BaseException) -> None:
        self._deadline = self._clock() + self.grace_s
        log.error(
            "the loop died; this process exits with status %d in %.0f s", EXIT_LOOP_FAILED, self.grace_s
        )
        self._timer = threading.Timer(self.grace_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        if self.request_exit is None:
            log.error("no exit hook installed (app served in-process): staying up")
            return
        log.error("exiting with status %d: the loop died %.0f s ago", EXIT_LOOP_FAILED, self.grace_s)
        self.request_exit(EXIT_LOOP_FAILED)

    def exit_in_s(self) -> float | None:
        """Seconds until the exit is requested; None while no loop has died."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._clock())
