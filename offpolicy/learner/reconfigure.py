"""The learner's config and its version, with one owner: `ConfigSwitch` holds the config a learner trains
with, the version it was applied as, and the config queued for the next step boundary.

The API's thread `submit`s a config with the version its numbering gave it (the service's `ConfigControl`,
services/learner_api/control.py, numbers what it accepts; a direct caller passes its own); frozen fields
are refused at once. The loop `take`s it at the step boundary and applies it whole: the optimizer's and
the critic's hyper-parameters (`build.set_hparams`, the one function for both) and the buffer's table
follow it, the gauge, the trackers and `on_applied` hear of it, and on N ranks the leader's channel
carries it to every rank with its next command. A follower `receive`s what that command carried; a resume
applies the checkpoint's config as version 1.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.build import Trainables, set_hparams
from offpolicy.learner.config import LearnerConfig, frozen_field_changes
from offpolicy.learner.distributed import LeaderChannel, Ranks
from offpolicy.learner.errors import FrozenFieldChange
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.tracking import Tracker

log = logging.getLogger(__name__)

ConfigApplied = Callable[[int, int], None]
"""`on_applied(config_version, step)`: called from the loop's thread at the step boundary where a config
took effect; `step` = learner steps completed before it (step + 1 is the first to run with it)."""


class ConfigSwitch:
    """The config a learner trains with (`config`, `version`, `applied_at_step`) and the one queued.

    Given at build: the objects a config change reaches (the trainables' optimizers, the leader's buffer
    and channel, the metrics and trackers, the service's `on_applied`)."""

    def __init__(
        self,
        config: LearnerConfig,
        ranks: Ranks,
        trainables: Trainables,
        metrics: LearnerMetrics,
        tracker: Tracker,
        buffer: ReplayBuffer | None = None,
        channel: LeaderChannel | None = None,
        on_applied: ConfigApplied | None = None,
    ) -> None:
        self._config, self.version, self.applied_at_step = config, 0, 0
        self._bound: int | None = None  # the staleness controller's bound (learner/control/); None: given
        self._effective = config
        self._ranks, self._trainables, self._metrics, self._tracker = ranks, trainables, metrics, tracker
        self._buffer, self._channel, self._on_applied = buffer, channel, on_applied
        self._pending: tuple[LearnerConfig, int] | None = None
        self._lock = threading.Lock()  # guards _pending: the API's thread submits, the loop takes
        metrics.record_config(0, config)

    @property
    def config(self) -> LearnerConfig:
        """The config the learner trains with now (read-only: it changes only at a step boundary): the
        given one, with the staleness controller's bound as `buffer.max_staleness` while it sets one."""
        return self._effective

    @property
    def given(self) -> LearnerConfig:
        """The config as given (start-up file, resumed checkpoint, PUT / PATCH): what checkpoints keep and
        PATCHes merge into."""
        return self._config

    def set_staleness(self, bound: int | None) -> None:
        """At a step boundary: train with `bound` as `buffer.max_staleness` (None: the given value); the
        buffer's table follows at once, as after a PATCH of it."""
        self._bound = bound
        self._apply(self._config)

    def _apply(self, given: LearnerConfig) -> None:
        """Make `given` (with the controller's bound) the config in force; the buffer follows."""
        buffer = given.buffer
        if self._bound is not None and buffer.max_staleness != self._bound:
            buffer = buffer.model_copy(update={"max_staleness": self._bound})
        effective = given if buffer is given.buffer else given.model_copy(update={"buffer": buffer})
        if effective.buffer != self._effective.buffer and self._buffer is not None:
            self._buffer.reconfigure(effective.buffer)  # same buffer object, connections and metrics registry
        self._config, self._effective = given, effective
        s = effective.buffer.max_staleness
        self._metrics.max_staleness.set(float("inf") if s is None else s)

    def submit(self, new: LearnerConfig, version: int) -> None:
        """Queue `new` as config `version`; it takes effect at the next step boundary (a newer submit
        replaces a queued one). Frozen fields raise `FrozenFieldChange` at once, and nothing is queued; so do
        router-loss coefficients above 0 (`moe`) for a dense policy, which has no routers."""
        changed = frozen_field_changes(self._config, new)
        if new.moe.on and getattr(self._trainables.policy, "router", None) is None:  # a dense policy
            changed += [f"moe.{k}" for k in ("aux_loss_coef", "z_loss_coef") if getattr(new.moe, k) > 0]
        if changed:
            raise FrozenFieldChange(changed)
        with self._lock:
            self._pending = (new, version)

    def take(self, step: int) -> None:
        """At the step boundary after `step` learner steps: apply the queued config. It stays queued until
        applied whole: a Redis outage during the buffer's reconfiguration raises, the loop retries, and the
        next attempt applies it again (idempotent)."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return
        new, version = pending
        self._switch(new, force=False)
        self.version, self.applied_at_step = version, step
        with self._lock:
            if self._pending is pending:  # a newer config queued meanwhile stays queued
                self._pending = None
        self._metrics.record_config(version, self._effective)
        self._tracker.log_config(new, "api", version, step)
        log.info("rank %d applied config version %d at step %d", self._ranks.rank, version, step)
        if self._on_applied is not None:
            self._on_applied(version, step)
        if self._channel is not None:
            self._channel.config_applied(new, version)  # the next command carries it to every rank

    def receive(self, new: LearnerConfig, version: int, step: int) -> None:
        """Follower: apply the config the leader's command carried (checked there already)."""
        with self._lock:
            self._pending = (new, version)
        self.take(step)

    def resume(self, config: LearnerConfig, step: int) -> None:
        """A resumed checkpoint's config, applied as version 1: the restored optimizer and schedule are
        re-aligned with it (learning rate and schedule included)."""
        self._switch(config, force=True)
        self.version, self.applied_at_step = 1, step
        self._metrics.record_config(1, self._effective)

    def _switch(self, new: LearnerConfig, force: bool) -> None:
        """Train with `new` from now on: the hyper-parameters and the buffer's table follow it."""
        set_hparams(self._trainables, None if force else self._config, new)
        self._apply(new)
