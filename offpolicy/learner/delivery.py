"""At-least-once delivery on the learner's side: which leases to acknowledge, when, and what to give back.

The learner leases its groups (buffer/leases.py) under one consumer name per run, so a restarted learner
finds the leases of the one that died. A lease is acknowledged once the update that used it is durable:

- `delivery: checkpoint` (the default with periodic checkpoints): each checkpoint records the lease ids
  trained since the last acknowledgement (`lease_ids` in its meta, with their groups' new priorities in
  `lease_priorities`); when the checkpoint is on disk they are acked. On restart the learner first acks
  what its resumed checkpoint holds (the crash may have come between the write and the ack), then
  releases every other lease of its consumer: those groups' updates were lost with the process, so they
  go back to the buffer and are trained again, once, in the resumed history. Leased groups stay in Redis
  until acknowledged: up to `checkpoint_every` steps of groups.
- `delivery: step`: acked right after the update (runs without checkpoints; a crash loses the update but
  not the group's count).

With `priorities.update` each lease's group priority (learner/rl/priorities.py), computed when it was
trained, goes with its acknowledgement: one script call acks the leases and re-prioritises the groups that
stay in the buffer.

A helper thread renews the consumer's leases every `lease_s / 4` while the process lives (also while paused
or waiting for Redis), so only a dead learner's leases expire, back into the buffer after `lease_s`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from offpolicy.buffer.errors import StorageUnavailable

if TYPE_CHECKING:
    from offpolicy.buffer.replay_buffer import ReplayBuffer
    from offpolicy.learner.metrics import LearnerMetrics

log = logging.getLogger(__name__)


def consumer_name(run_id: str) -> str:
    """The learner's consumer name in the buffer: stable per run, so a restart finds its leases."""
    return "learner." + re.sub(r"[^A-Za-z0-9_.:-]", "_", run_id)[:100]


class Delivery:
    """The leases one learner holds: trained and not yet acknowledged, and the checkpoints that hold them."""

    def __init__(
        self, buffer: ReplayBuffer, run_id: str, mode: str, lease_s: float, metrics: LearnerMetrics
    ) -> None:
        self.buffer, self.mode, self.lease_s, self.metrics = buffer, mode, lease_s, metrics
        self.consumer = consumer_name(run_id)
        self.unacked: list[str] = []  # trained, not acknowledged yet (in training order)
        self.priorities: dict[str, float] = {}  # lease id -> its group's new priority, written with its ack
        self._in_checkpoint: dict[int, list[str]] = {}  # checkpoint version -> lease ids it holds
        self._durable: list[int] = []  # checkpoint versions the writer made durable, not acked yet
        self._lock = threading.Lock()  # guards _durable (appended from the writer thread)
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="offpolicy-lease-renewal", daemon=True)

    # --- start: recover what a previous process of this run left

    def recover(
        self, checkpoint_lease_ids: Sequence[str], checkpoint_priorities: dict[str, float] | None = None
    ) -> None:
        """Ack the leases the resumed checkpoint holds (with the priorities it recorded for them: a crash
        between the write and the ack loses none), give every other lease of this consumer back to the
        buffer (counted `redelivered`), then start renewing."""
        if checkpoint_lease_ids:
            given = checkpoint_priorities or {}
            acked = self._ack_call(list(checkpoint_lease_ids), given)
            log.info("acked %d lease(s) of the resumed checkpoint", acked.acked)
        released = self.buffer.release(self.consumer)
        if released:
            log.warning("released %d lease(s) whose updates were lost: back in the buffer", released)
        self._renewer.start()

    # --- the training thread

    def trained(self, lease_ids: Sequence[str], priorities: Sequence[float] | None = None) -> None:
        """The step's update used these leases (`priorities`: their groups' new priorities, one each, to
        write with the ack); with `delivery: step` they are acked now."""
        self.unacked.extend(lease_ids)
        if priorities is not None:
            self.priorities.update(zip(lease_ids, priorities, strict=True))
        if self.mode == "step":
            self._ack(list(self.unacked))

    def checkpointed(self, version: int) -> tuple[list[str], dict[str, float]]:
        """The lease ids a checkpoint at `version` holds (every trained, unacknowledged lease) and their
        groups' new priorities (those that have one), for its meta: `recover` acks them with these."""
        ids = list(self.unacked)
        self._in_checkpoint[version] = ids
        return ids, {i: self.priorities[i] for i in ids if i in self.priorities}

    def durable(self, version: int) -> None:
        """Writer thread: the checkpoint at `version` is on disk (acked by the next `ack_durable`)."""
        with self._lock:
            self._durable.append(version)

    def ack_durable(self) -> None:
        """Ack the leases of the checkpoints that became durable (and of the older ones they cover)."""
        with self._lock:
            versions, self._durable = self._durable, []
        if not versions:
            return
        newest = max(versions)
        ids = self._in_checkpoint.get(newest, [])
        self._ack(ids)
        for v in [v for v in self._in_checkpoint if v <= newest]:
            del self._in_checkpoint[v]

    def _ack(self, ids: list[str]) -> None:
        if not ids:
            return
        result = self._ack_call(ids, self.priorities)
        for i in ids:
            self.priorities.pop(i, None)
        if result.unknown:  # expired while Redis was unreachable: the groups went back and may train again
            log.warning(
                "%d lease(s) were lost before their ack (expired): at-least-once", len(result.unknown)
            )
            self.metrics.leases_lost.inc(len(result.unknown))
        done = set(ids)
        self.unacked = [i for i in self.unacked if i not in done]

    def _ack_call(self, ids: list[str], priorities: dict[str, float]) -> Any:
        """One ack script call for `ids`, with the priorities `priorities` holds for them (if any)."""
        each = [priorities.get(i) for i in ids]
        if any(p is not None for p in each):
            return self.buffer.ack(self.consumer, ids, each)
        return self.buffer.ack(self.consumer, ids)

    # --- the renewal thread, and stop

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.buffer.renew(self.consumer, self.lease_s)
            except StorageUnavailable as exc:  # retried at the next tick; leases outlive short outages
                log.warning("lease renewal failed, retrying in %.0f s: %s", self.lease_s / 4, exc)

    def close(self, release: bool = True) -> None:
        """Stop renewing; with `release`, give the unacknowledged leases back (their updates are not in a
        durable checkpoint, so they must be trained again)."""
        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join()
        if release and self.unacked:
            self.buffer.release(self.consumer, list(self.unacked))
            self.unacked = []
            self.priorities.clear()
