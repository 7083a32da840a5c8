"""Config changes at step boundaries, as a mixin of `Learner` (learner/trainer.py): `apply_config` (from the
API's thread) queues a config, frozen fields refused at once; the loop applies it whole at the next
boundary (`_apply_pending`: the optimizer's and critic's hyper-parameters and the buffer's table follow it,
the gauge, the trackers and `on_config_applied` hear of it, and on N ranks the next command carries it).

`Learner` provides what these read: `config`, `config_version`, `config_applied_at_step`, `step_count`,
`ranks`, `metrics`, `tracker`, `channel`, `persist`, `buffer`, `optimizer`, `scheduler`,
`critic_optimizer`, `_lock`, `_pending` and `_on_config_applied`.
"""

from __future__ import annotations

import logging

from offpolicy.learner.build import set_optimizer_hparams
from offpolicy.learner.config import LearnerConfig, frozen_field_changes
from offpolicy.learner.errors import FrozenFieldChange

log = logging.getLogger(__name__)


class Reconfiguring:
    """`Learner`'s config changes at step boundaries (module docstring)."""

    def apply_config(self, new_config: LearnerConfig, config_version: int | None = None) -> None:
        """Queue `new_config`; it takes effect at the next step boundary. Frozen fields raise at once.

        When it takes effect, `status()` shows `config_version` and `config_applied_at_step`, the gauge
        `offpolicy_learner_config_version` moves, and `on_config_applied(version, step)` is called."""
        changed = frozen_field_changes(self.config, new_config)
        if changed:
            raise FrozenFieldChange(changed)
        with self._lock:
            self._pending = (
                new_config,
                self.config_version + 1 if config_version is None else config_version,
            )

    def _apply_pending(self) -> None:
        """Apply the queued config. It stays queued until applied whole: a Redis outage during the buffer's
        reconfiguration raises, the loop retries, and the next attempt applies it again (idempotent)."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return
        new, version = pending
        self._switch_config(new, force_optimizer=False)
        self.config_version, self.config_applied_at_step = version, self.step_count
        with self._lock:
            if self._pending is pending:  # a newer config queued meanwhile stays queued
                self._pending = None
        self.metrics.record_config(version, new)
        self.tracker.log_config(new, "api", version, self.step_count)
        log.info("rank %d applied config version %d at step %d", self.ranks.rank, version, self.step_count)
        if self._on_config_applied is not None:
            self._on_config_applied(version, self.step_count)
        if self.channel is not None:
            self.channel.config_applied(*pending)  # the next command carries it to every rank

    def _switch_config(self, new: LearnerConfig, force_optimizer: bool) -> None:
        """Train with `new` from now on: the optimizer's and critic's hyper-parameters and the buffer's
        table follow it, and the next checkpoint saves it."""
        if force_optimizer or new.optimizer != self.config.optimizer:
            set_optimizer_hparams(self.optimizer, self.scheduler, new.optimizer)
        if self.critic_optimizer is not None and (force_optimizer or new.critic.lr != self.config.critic.lr):
            for g in self.critic_optimizer.param_groups:
                g["lr"] = new.critic.lr
        if new.buffer != self.config.buffer and self.buffer is not None:
            self.buffer.reconfigure(new.buffer)  # same buffer object, connections and metrics registry
        self.config = self.persist.config = new
