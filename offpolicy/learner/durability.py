"""What makes the learner's updates durable, as a mixin of `Learner` (learner/trainer.py): checkpoints
taken between steps (`checkpoint()` from another thread, `_checkpoint` when due), the steps a durable
checkpoint does not cover yet and the intake's stop at `checkpoint.max_undurable_steps` (`IntakeStopped`),
the writer thread's durability callback, and the counters and config a resumed checkpoint restores.

`Learner` provides what these read: `config`, `ranks`, `persist`, `publisher`, `buffer`, `delivery`,
`store`, `channel`, `metrics`, `version`, `step_count`, `durable_step`, `config_version`,
`config_applied_at_step`, `resumed`, `_checkpoint_steps`, `_publish_keys`, `_step_lock`, `trainables()` and
`_switch_config()`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from offpolicy.learner.config.resume import resumed_config
from offpolicy.learner.errors import IntakeStopped

log = logging.getLogger(__name__)


class Durability:
    """`Learner`'s checkpoints, durability cap and resume (module docstring)."""

    def checkpoint(self) -> tuple[Path, int]:
        """Checkpoint now (after the running step, if any) and wait until it is durable; training goes on
        meanwhile. Returns (folder, version). On N ranks the loop takes it at its next step boundary (every
        rank checkpoints its shards) and this waits for that."""
        if self.ranks.distributed:
            if self.config.checkpoint_path is None:
                self.persist.checkpoint(self.trainables(), 0, 0, {})  # raises CheckpointsDisabled
            assert self.channel is not None, "checkpoint() is the leader's"
            return self.channel.request_checkpoint()
        with self._step_lock:
            path, version = self._checkpoint(), self.version
        self.persist.writer.flush(kind="checkpoint")  # a full disk: WriteFailed, the write retried
        return path, version

    def undurable_steps(self) -> int:
        """Learner steps not covered by a durable checkpoint (0 without checkpoints: nothing to cover)."""
        return self.step_count - self.durable_step if self.config.checkpoint_path is not None else 0

    def _check_durability(self) -> None:
        """Raise `IntakeStopped` while `checkpoint.max_undurable_steps` steps are not covered by a durable
        checkpoint (checkpoints failing); one process: a checkpoint is queued if none waits for a retry."""
        cap = self.config.checkpoint.undurable_cap if self.config.checkpoint_path is not None else None
        undurable = self.undurable_steps()
        self.metrics.undurable_steps.set(undurable)
        self.metrics.intake_blocked.set(cap is not None and undurable >= cap)
        if cap is None or undurable < cap:
            return
        if not self.ranks.distributed and not self.persist.checkpoint_pending():
            with self._step_lock:
                self._checkpoint()
        failing = self.persist.troubles.get("checkpoint")
        why = f"{failing['error']} on {failing['path']}" if failing else "the checkpoint is not durable yet"
        raise IntakeStopped(
            f"intake stopped: {undurable} learner steps are not covered by a durable checkpoint "
            f"(checkpoint.max_undurable_steps = {cap}): {why}"
        )

    def _checkpoint(self) -> Path:
        """Snapshot a checkpoint and queue its write; return the folder it will have."""
        position, leases, priorities = {}, [], {}
        if self.buffer is not None and self.delivery is not None:  # the leader's (its meta is the one kept)
            stats = self.buffer.stats()
            position = {"inserted_total": stats.inserted_total, "sampled_total": stats.sampled_total}
            leases, priorities = self.delivery.checkpointed(self.version)
        self.publisher.at_checkpoint(self.version, self._publish_keys if self.ranks.distributed else None)
        self._checkpoint_steps[self.version] = self.step_count
        return self.persist.checkpoint(
            self.trainables(), self.version, self.step_count, position, leases, self.config_version,
            lease_priorities=priorities,
        )  # fmt: skip

    def _on_durable(self, kind: str, version: int) -> None:
        """Writer thread: a write became durable; a checkpoint's leases are acked by the next step."""
        if kind == "checkpoint":
            steps = [s for v, s in list(self._checkpoint_steps.items()) if v <= version]
            self.durable_step = max([self.durable_step, *steps])
            if self.delivery is not None:
                self.delivery.durable(version)

    def _resumed(self, meta: dict[str, Any]) -> None:
        """Take the resumed checkpoint's counters. The version is always that of the weights we hold:
        versions published after that checkpoint are superseded (`_start` re-publishes ours)."""
        self.version, self.step_count = int(meta["version"]), int(meta["step"])
        # the checkpoint's config or the file's (checkpoint.resume_config); the optimizer and scheduler
        # restored from the checkpoint are re-aligned with it (learning rate and schedule included)
        self.resumed = resumed_config(self.config, meta)
        self._switch_config(self.resumed.config, force_optimizer=True)
        self.config_version, self.config_applied_at_step = 1, self.step_count
        self.metrics.record_config(1, self.config)
        record = self.store.read() if self.store is not None else None
        if record is not None and record.version > self.version:
            log.warning(
                "published v%d is newer than checkpoint v%d: its weights are lost; re-publishing v%d",
                record.version, self.version, self.version,
            )  # fmt: skip
