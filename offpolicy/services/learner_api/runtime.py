"""The learner service's domain side: builds the `Learner`, hosts its loop thread, owns config changes."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.json_records import group_from_json
from offpolicy.buffer.types import InsertResult
from offpolicy.config.secrets import Redactor, url_secrets
from offpolicy.learner.config import LearnerConfig
from offpolicy.services.common.background import BackgroundLoop, FailureHook
from offpolicy.services.common.errors import NotReady
from offpolicy.services.learner_api.control import ConfigControl
from offpolicy.services.learner_api.preset_schemas import get_preset, list_presets
from offpolicy.services.learner_api.schemas import (
    CheckpointResult,
    DeadLetter,
    DeadLetterList,
    IngestResult,
    LearnerStatus,
    Preset,
)

log = logging.getLogger(__name__)

ConfigApplied = Callable[[int, int], None]
"""`(config_version, step)`: the learner calls it at the step boundary where a config took effect."""


class DeadLetterSource(Protocol):
    """What the service uses of the learner's buffer (`offpolicy.buffer.replay_buffer.ReplayBuffer`)."""

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]: ...


class LearnerLike(Protocol):
    """What the service uses of `offpolicy.learner.trainer.Learner` (docs/architecture.md)."""

    state: str
    """`running`, `waiting_for_data`, `waiting_for_redis`, `paused`, `finished`, `stopped`, ..."""
    retrying: str | None
    """Why the loop is retrying transient trouble (Redis unreachable) or takes no new groups (checkpoints
    failing at `checkpoint.max_undurable_steps`) right now; None when it is not."""
    buffer: DeadLetterSource

    def run(self, stop_event: threading.Event) -> None: ...
    def apply_config(self, new_config: LearnerConfig, config_version: int | None = None) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def checkpoint(self) -> tuple[Any, int]: ...
    def status(self) -> dict[str, Any]: ...


LearnerFactory = Callable[[LearnerConfig, CollectorRegistry, ConfigApplied], LearnerLike]
"""Builds the learner on the service's registry; it exports `offpolicy_learner_config_version` there and
reports each applied config through the callback (`offpolicy.learner.trainer.Learner(config, registry,
callback)`)."""


class LearnerRuntime:
    """One learner, its loop thread and its config history; built and started by the app's lifespan."""

    def __init__(self, config: LearnerConfig, registry: CollectorRegistry, factory: LearnerFactory) -> None:
        self.config = config
        self.registry = registry
        self._factory = factory
        self.learner: LearnerLike | None = None
        self.loop: BackgroundLoop | None = None
        self.control = ConfigControl(config, self._hand_over)
        self.redactor = Redactor(url_secrets(config.redis_url))
        """The secrets of the config (Redis password): no status, readiness reason or log shows them."""

    def start(self, on_failure: FailureHook | None = None) -> None:
        """Build the learner (loads the model, resumes, publishes v0) and start `run(stop_event)`;
        `on_failure` is called if the loop dies (the service's exit-after-grace)."""
        self.learner = self._factory(self.config, self.registry, self.control.mark_applied)
        resumed = getattr(self.learner, "resumed", None)
        if resumed is not None:  # the history and GET /v1/config show what the resumed learner runs
            step = int(getattr(self.learner, "config_applied_at_step", 0))
            self.control.record_resume(resumed.config, step, resumed.disagreeing, resumed.detail)
        self.loop = BackgroundLoop(self.learner.run, "learner", on_failure)
        self.loop.start()
        log.info("learner loop started", extra={"model_path": self.config.model_path})

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the loop at its next step boundary (waits for a running step)."""
        if self.loop is not None and not self.loop.stop(timeout_s):
            log.error("the learner loop did not stop within %.0f s", timeout_s)
            return
        close = getattr(self.learner, "close", None)
        if close is not None:  # queued publishes and checkpoints made durable, leases settled
            close()

    def control_history(self) -> list[dict[str, Any]]:
        """The staleness controller's changes, oldest first (learner/control/); none before it starts."""
        control = getattr(self.learner, "control", None)
        return control.history() if control is not None else []

    def require(self) -> LearnerLike:
        if self.learner is None:
            raise NotReady("the learner is still starting (loading the model)")
        return self.learner

    # --- config versions: the service numbers them, the learner switches at a step boundary and
    # reports back through `control.mark_applied(version, step)`

    def _hand_over(self, config: LearnerConfig, config_version: int) -> None:
        self.require().apply_config(config, config_version)

    # --- what the routes call

    def readiness(self) -> str | None:
        if self.learner is None or self.loop is None:
            return "the learner is still starting (loading the model)"
        reason = self.loop.readiness()
        if reason is None and self.learner.retrying is not None:
            reason = f"learner {self.learner.state}: {self.learner.retrying}"
        return None if reason is None else self.redactor.scrub(reason)

    def liveness(self) -> str | None:
        """None while the loop lives (or ended on its own); why it died otherwise (`/healthz` 503)."""
        reason = self.loop.failure() if self.loop is not None else None
        return None if reason is None else self.redactor.scrub(reason)

    def presets(self) -> list[Preset]:
        return list_presets()

    def preset(self, name: str) -> Preset:
        return get_preset(name)

    def status(self) -> LearnerStatus:
        running, pending = self.control.running().config_version, self.control.pending_version()
        if self.learner is None:
            return LearnerStatus(
                state="starting",
                policy_version=0,
                step=0,
                config_version=running,
                pending_config_version=pending,
                tokens_per_s=None,
                buffer={},
                last_step={},
            )
        raw = self.learner.status()
        state, error = str(raw["state"]), None
        if self.loop is not None and self.loop.error is not None:
            state, error = (
                "failed",
                self.redactor.scrub(f"{type(self.loop.error).__name__}: {self.loop.error}"),
            )
        buffer = raw.get("buffer")
        return LearnerStatus(
            state=state,
            policy_version=int(raw["policy_version"]),
            step=int(raw["step"]),
            versions_per_step=raw.get("versions_per_step"),
            config_version=running,
            pending_config_version=pending,
            tokens_per_s=raw.get("tokens_per_s"),
            world_size=int(raw.get("world_size", 1)),
            buffer=dataclasses.asdict(buffer) if dataclasses.is_dataclass(buffer) else dict(buffer or {}),
            last_step={k: None if v is None else float(v) for k, v in (raw.get("last_step") or {}).items()},
            memory_plan=raw.get("memory_plan"),
            settings=raw.get("settings"),
            grad_sync=raw.get("grad_sync"),
            start_way=raw.get("start_way"),
            host_memory_plan=raw.get("host_memory_plan"),
            writes_failing=raw.get("writes_failing") or {},
            transfer=raw.get("transfer"),
            intake_stopped=raw.get("intake_stopped"),
            undurable_steps=int(raw.get("undurable_steps", 0)),
            control=raw.get("control"),
            groups_dropped={k: int(v) for k, v in (raw.get("groups_dropped") or {}).items()},
            error=error,
        )

    def ingest(self, docs: list[dict[str, Any]]) -> IngestResult:
        """Insert groups posted as JSON: a document of the wrong shape or with bad values is rejected by
        field (by its group_id, or `#<index>`), the rest go to the buffer as an actor's would."""
        groups, rejected = [], {}
        for i, doc in enumerate(docs):
            key = doc.get("group_id") or f"#{i}"
            try:
                groups.append(group_from_json(doc))
            except InvalidTrajectory as exc:
                rejected[str(key)] = exc.field
        result = self.require().buffer.insert_many(groups) if groups else InsertResult()
        rejected |= result.rejected
        return IngestResult(
            inserted=list(result.inserted), duplicates=list(result.duplicates), rejected=rejected
        )

    def dead_letters(self, limit: int) -> DeadLetterList:
        entries = self.require().buffer.dead_letters(limit)
        return DeadLetterList(entries=[DeadLetter(**e) for e in entries])

    def pause(self) -> LearnerStatus:
        self.require().pause()
        return self.status()

    def resume(self) -> LearnerStatus:
        self.require().resume()
        return self.status()

    def checkpoint(self) -> CheckpointResult:
        path, version = self.require().checkpoint()  # CheckpointsDisabled (409) without a checkpoint_dir
        return CheckpointResult(path=str(path), policy_version=version)
