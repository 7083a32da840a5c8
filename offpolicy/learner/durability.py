"""What makes the learner's updates durable: `Durability` owns the durable step (learner steps covered by
the newest durable checkpoint), the step of each checkpoint queued and not yet durable, the cap
`checkpoint.max_undurable_steps` (the intake stops at it: `IntakeStopped`), and `on_durable`, the writer
thread's callback when a write lands.

The learner (learner/trainer.py) takes checkpoints (`Learner._checkpoint`) and tells this object of each
one queued (`queued`); the writer thread calls `on_durable`; the loop's step calls `check` before it takes
groups.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.delivery import Delivery
from offpolicy.learner.distributed import Ranks
from offpolicy.learner.errors import IntakeStopped
from offpolicy.learner.metrics import LearnerMetrics


class Writes(Protocol):
    """What `check` reads of the background writes (learner/persist/: `Persistence`)."""

    troubles: Mapping[str, Mapping[str, Any]]

    def checkpoint_pending(self) -> bool: ...


class Durability:
    """The durable step, the queued checkpoints' steps, the cap and `on_durable` (module docstring).

    `delivery` (the leader's): a durable checkpoint's leases are acked by the next step."""

    def __init__(self, ranks: Ranks, metrics: LearnerMetrics, delivery: Delivery | None) -> None:
        self._ranks, self._metrics, self._delivery = ranks, metrics, delivery
        self.durable_step = 0
        """Learner steps covered by the newest durable checkpoint."""
        self._queued: dict[int, int] = {}  # checkpoint version queued -> its step count
        self._lock = threading.Lock()  # the writer thread and the loop's both touch _queued

    def resumed_at(self, step: int) -> None:
        """A resumed checkpoint covers its `step` learner steps."""
        self.durable_step = step

    def queued(self, version: int, step: int) -> None:
        """A checkpoint of policy `version` was queued after `step` learner steps."""
        with self._lock:
            self._queued[version] = step

    def on_durable(self, kind: str, version: int) -> None:
        """Writer thread: a write became durable; a checkpoint's leases are acked by the next step."""
        if kind != "checkpoint":
            return
        with self._lock:
            steps = [s for v, s in self._queued.items() if v <= version]
            for v in [v for v in self._queued if v <= version]:
                del self._queued[v]
        self.durable_step = max([self.durable_step, *steps])
        if self._delivery is not None:
            self._delivery.durable(version)

    def undurable_steps(self, config: LearnerConfig, step: int) -> int:
        """Learner steps not covered by a durable checkpoint (0 without checkpoints: nothing to cover)."""
        return step - self.durable_step if config.checkpoint_path is not None else 0

    def check(self, config: LearnerConfig, step: int, writes: Writes, checkpoint: Callable[[], Any]) -> None:
        """Raise `IntakeStopped` while `checkpoint.max_undurable_steps` steps are not covered by a durable
        checkpoint (checkpoints failing); one process: `checkpoint()` queues one first if none waits for a
        retry."""
        cap = config.checkpoint.undurable_cap if config.checkpoint_path is not None else None
        undurable = self.undurable_steps(config, step)
        self._metrics.undurable_steps.set(undurable)
        self._metrics.intake_blocked.set(cap is not None and undurable >= cap)
        if cap is None or undurable < cap:
            return
        if not self._ranks.distributed and not writes.checkpoint_pending():
            checkpoint()
        failing = writes.troubles.get("checkpoint")
        why = f"{failing['error']} on {failing['path']}" if failing else "the checkpoint is not durable yet"
        raise IntakeStopped(
            f"intake stopped: {undurable} learner steps are not covered by a durable checkpoint "
            f"(checkpoint.max_undurable_steps = {cap}): {why}"
        )
