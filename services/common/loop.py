"""Host a domain loop (`run(stop_event)`) in a background thread of a service process, stopped by handle."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundLoop:
    """Runs `target(stop_event)` in a daemon thread; `stop()` sets the event and joins with a bound.

    If the loop raises, the exception is logged and kept in `error` so that `/readyz` reports it; the
    service keeps serving its status and metrics, which is what an operator needs to see what happened.
    """

    def __init__(self, target: Callable[[threading.Event], object], name: str) -> None:
        self._target = target
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        try:
            self._target(self._stop)
        except Exception as exc:  # translated: kept for /readyz and logged with its traceback
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

    def readiness(self) -> str | None:
        """None unless the loop raised (a loop that returned on its own, e.g. at max_steps, is fine)."""
        if self.error is not None:
            return f"{self._thread.name} loop failed: {type(self.error).__name__}: {self.error}"
        return None

    def __repr__(self) -> str:
        return f"BackgroundLoop({self._thread.name!r})"
