"""The learner service's domain side: builds the `Learner`, hosts its loop thread, owns config changes."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from learner.config import LearnerConfig
from services.common.errors import NotReady
from services.common.loop import BackgroundLoop
from services.learner_api.control import ConfigControl
from services.learner_api.presets import get_preset, list_presets
from services.learner_api.schemas import CheckpointResult, LearnerStatus, Preset

log = logging.getLogger(__name__)


class LearnerLike(Protocol):
    """What the service calls on `learner.train.Learner` (docs/architecture.md)."""

    def run(self, stop_event: Any) -> Any: ...
    def apply_config(self, config: LearnerConfig, config_version: int) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def checkpoint(self) -> Any: ...
    def status(self) -> Any: ...


LearnerFactory = Callable[[LearnerConfig, CollectorRegistry], LearnerLike]


class LearnerRuntime:
    """One learner, its loop thread and its config history; built and started by the app's lifespan."""

    def __init__(self, config: LearnerConfig, registry: CollectorRegistry, factory: LearnerFactory) -> None:
        self.config = config
        self.registry = registry
        self._factory = factory
        self.learner: LearnerLike | None = None
        self.loop: BackgroundLoop | None = None
        self.control = ConfigControl(config, self._hand_over)
        self.started_at = time.time()

    def start(self) -> None:
        """Build the learner (loads the model: seconds to minutes) and start `run(stop_event)`."""
        self.learner = self._factory(self.config, self.registry)
        self.loop = BackgroundLoop(self.learner.run, "learner")
        self.loop.start()
        log.info("learner loop started", extra={"model_path": self.config.model_path})

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.loop is not None and not self.loop.stop(timeout_s):
            log.error("learner loop did not stop within %.0f s", timeout_s)

    def require(self) -> LearnerLike:
        if self.learner is None:
            raise NotReady("the learner is still starting (loading the model)")
        return self.learner

    def _hand_over(self, config: LearnerConfig, config_version: int) -> None:
        self.require().apply_config(config, config_version)

    # --- what the routes call

    def readiness(self) -> str | None:
        if self.learner is None or self.loop is None:
            return "the learner is still starting (loading the model)"
        return self.loop.readiness()

    def presets(self) -> list[Preset]:
        return list_presets()

    def preset(self, name: str) -> Preset:
        return get_preset(name)

    def status(self) -> LearnerStatus:
        if self.learner is None:
            return LearnerStatus(
                state="starting",
                policy_version=0,
                step=0,
                config_version=self.control.running().config_version,
                pending_config_version=self.control.pending_version(),
                tokens_per_s=None,
                buffer={},
                last_step={},
            )
        return status_model(self.learner.status(), self.control, self.loop)

    def checkpoint(self) -> CheckpointResult:
        path, version = self.require().checkpoint()
        return CheckpointResult(path=str(path), policy_version=version)


def status_model(raw: Any, control: ConfigControl, loop: BackgroundLoop | None) -> LearnerStatus:
    """The learner's `status()` as the API model, with the service's config versions and loop state."""
    state = str(raw.get("state", "running"))
    error = None
    if loop is not None and loop.error is not None:
        state, error = "failed", f"{type(loop.error).__name__}: {loop.error}"
    buffer = raw.get("buffer") or {}
    return LearnerStatus(
        state=state,
        policy_version=int(raw.get("policy_version", 0)),
        step=int(raw.get("step", 0)),
        config_version=control.running().config_version,
        pending_config_version=control.pending_version(),
        tokens_per_s=raw.get("tokens_per_s"),
        buffer=buffer if isinstance(buffer, dict) else dataclasses.asdict(buffer),
        last_step={k: float(v) for k, v in (raw.get("last_step") or {}).items()},
        error=error,
    )
