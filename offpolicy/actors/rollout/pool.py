"""An actor pool: one vLLM engine on one base model serves several runs, added and removed while it runs.

Each run is an `Actor` (rollout/actor.py) with its own config (its run id, Redis and buffer, dataset or
environment or gateway, sampling, reward, reload), its own stop event and thread, and its own metrics
registry; its share of the engine is its `max_inflight_prompts` (the prompts it keeps in the engine). On
an engine serving LoRA adapters (`engine.lora`) each run sees the engine through a `RunView`
(engine/run_view.py): its requests carry its own learner's newest adapter. A pool of full weights serves
one run (the engine's weights are that run's). Which runs may join is actors/config/pool.py.

Isolation: a run's failing reward drops that run's groups; its dead learner or full buffer holds back that
run's admissions (pacing, back-pressure); a record of the wrong kind is refused by that run's weight sync;
a run whose loop dies is reported failed (`runs()`), and the others go on. Only the engine's death is
everyone's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ActorConfig
from offpolicy.actors.config.pool import run_refusal
from offpolicy.actors.engine.vllm import VLLMEngine
from offpolicy.actors.errors import RunConflict, RunFieldFrozen, RunNotFound
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.actor import Actor
from offpolicy.config.loader import changed_fields, merge

log = logging.getLogger(__name__)

UPDATABLE = ("max_inflight_prompts", "sampling")
"""A run's fields that change while it runs (`Pool.update`); any other change is a remove and an add."""


class RunActor(Protocol):
    """What the pool calls on a run's `offpolicy.actors.rollout.actor.Actor`."""

    metrics: ActorMetrics

    def run(self, stop_event: threading.Event) -> Any: ...
    def status(self) -> Mapping[str, Any]: ...
    def reconfigure(self, config: ActorConfig) -> None: ...
    def close(self) -> None: ...


ActorFactory = Callable[[ActorConfig, CollectorRegistry, Any], RunActor]
"""Builds a run's actor from its config, its registry and the engine it uses (the pool's, or its view)."""
RunFailed = Callable[[str, BaseException], None]
"""Called from a run's thread, with its run id and the exception that ended its loop."""


def build_actor(config: ActorConfig, registry: CollectorRegistry, engine: Any) -> RunActor:
    """The default `ActorFactory`: an `Actor` on the pool's engine (which it does not own)."""
    return Actor(config, registry, engine=engine)


@dataclass(eq=False)
class Run:
    """One run of the pool: its config, actor, registry and loop thread (stopped by its own event)."""

    config: ActorConfig
    actor: RunActor
    registry: CollectorRegistry
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self, on_failure: RunFailed) -> None:
        self.thread = threading.Thread(
            target=self._main, args=(on_failure,), name=f"run-{self.config.run_id}", daemon=True
        )
        self.thread.start()

    def _main(self, on_failure: RunFailed) -> None:
        try:
            self.actor.run(self.stop)
        except Exception as exc:  # translated: kept for the run's status, handed to the pool's hook, logged
            self.error = exc
            self.actor.metrics.run_failed.set(1)  # offpolicy_actor_run_failed{run_id}: the alert
            log.exception("run %s: its loop stopped with an error; the pool's other runs go on", self.run_id)
            on_failure(self.run_id, exc)

    @property
    def run_id(self) -> str:
        return self.config.run_id

    @property
    def state(self) -> str:
        """`failed` (its loop died), `running`, or `stopped` (ended on its own, or stopped)."""
        if self.error is not None:
            return "failed"
        return "running" if self.thread is not None and self.thread.is_alive() else "stopped"

    def status(self) -> dict[str, Any]:
        """The actor's status with the run's id, state, share and error."""
        error = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return {
            **self.actor.status(),
            "run_id": self.run_id,
            "state": self.state,
            "max_inflight_prompts": self.config.max_inflight_prompts,
            "error": error,
        }


class Pool:
    """One engine, several runs (see the module docstring). `config` is the pool's (its `model_path` and
    `engine`, and its first runs: itself and its `runs`); `registry_for(run_id)` makes each run's metrics
    registry; `engine`: an engine to share (not stopped by `close`), None = `start` builds one."""

    def __init__(
        self,
        config: ActorConfig,
        registry_for: Callable[[str], CollectorRegistry],
        *,
        engine: Any = None,
        actor_factory: ActorFactory = build_actor,
        on_failure: RunFailed | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self._owns_engine = engine is None
        self._registry_for, self._actor_factory = registry_for, actor_factory
        self._on_failure = on_failure or (lambda run_id, exc: None)
        self._runs: dict[str, Run] = {}  # run id -> run, in the order they were added
        self._joining: set[str] = set()  # run ids being added (their actors are being built)
        self._lock = threading.Lock()

    # --- life cycle

    def start(self) -> None:
        """Build the engine (unless one was given) on the base model, then start the config's runs. Call it
        in the main thread (vLLM's engine start-up installs signal handlers and spawns workers)."""
        cfg = self.config
        if self.engine is None:
            transfer = cfg.reload.transfer.backend if cfg.reload.transport == "vllm" else None
            self.engine = VLLMEngine(
                cfg.engine, cfg.model_path, cfg.reload.initial_version, cfg.actor_index, transfer
            )
        if self.engine.kind != ("full" if cfg.engine.lora is None else "lora"):
            raise ValueError(f"the engine given serves {self.engine.kind} weights, not the config's engine")
        for run in (cfg.run_config, *cfg.runs):
            self.add(run)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop every run's loop (each within `timeout_s`), close the actors, stop the engine if ours."""
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.stop.set()
        for run in runs:
            self._join(run, timeout_s)
            run.actor.close()
            if not self._owns_engine and self.engine.kind == "lora":  # a shared engine serves on
                self.engine.call(self.engine.drop_run(run.run_id))
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()

    # --- runs

    def add(self, config: ActorConfig) -> dict[str, Any]:
        """Start serving run `config` (its `model_path` and `engine` the pool's); its status. `RunConflict`
        when it cannot join (actors/config/pool.py says why, with the fix)."""
        if config.runs:
            raise RunConflict(f"run {config.run_id!r}: a run of the pool has no `runs` of its own")
        run_id = config.run_id
        with self._lock:
            served = [*self._runs, *self._joining]
            why = run_refusal(
                self.config.model_path, self.config.engine, served, run_id, config.model_path, config.engine
            )
            if why is None and self.engine.kind == "full" and self.engine.base_loads:
                why = (
                    "this actor pool serves full weights, and its engine holds the weights of a run it "
                    "served before: restart the actor for another run (or serve LoRA adapters: engine.lora)"
                )
            if why is not None:
                raise RunConflict(why)
            self._joining.add(run_id)
        try:
            run = self._build(config)
            with self._lock:
                self._runs[run_id] = run  # before its thread starts: a loop that dies at once is counted
            run.start(self._on_failure)
        finally:
            with self._lock:
                self._joining.discard(run_id)
        log.info("run %s added to the pool (%d runs)", run_id, len(self._runs))
        return run.status()

    def _build(self, config: ActorConfig) -> Run:
        """The run's registry and actor, on the engine (a full-weight pool's one run) or its view (LoRA)."""
        registry = self._registry_for(config.run_id)
        engine = self.engine
        if engine.kind == "lora":
            engine = engine.call(engine.add_run(config.run_id, config.reload.initial_version))
        try:
            return Run(config, self._actor_factory(config, registry, engine), registry)
        except BaseException:
            if self.engine.kind == "lora":
                self.engine.call(self.engine.drop_run(config.run_id))
            raise

    def update(self, run_id: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Merge `patch` (nested keys) into run `run_id`'s config and apply it from its next admission;
        its status. Only `UPDATABLE` fields may change (`RunFieldFrozen` names the others: remove the run
        and add it again); pydantic's `ValidationError` for an invalid result."""
        with self._lock:
            run = self._get(run_id)
            old = run.config.model_dump(mode="json")
            new = ActorConfig.model_validate(merge(run.config.model_dump(), patch))
            changed = changed_fields(old, new.model_dump(mode="json"))
            frozen = sorted(f for f in changed if f.split(".")[0] not in UPDATABLE)
            if frozen:
                raise RunFieldFrozen(
                    f"run {run_id!r}: {', '.join(frozen)} cannot change while the run runs (only "
                    f"{', '.join(UPDATABLE)} do): remove the run and add it again with them",
                    frozen,
                )
            if any(f.startswith("sampling.") for f in changed) and new.gateway.enabled:
                raise RunFieldFrozen(
                    f"run {run_id!r}: sampling cannot change on a run with gateway.enabled (its episodes "
                    "keep the sampling they opened with): remove the run and add it again",
                    ["sampling"],
                )
            if changed:
                run.actor.reconfigure(new)
                run.config = new
                log.info("run %s changed: %s", run_id, ", ".join(changed))
        return run.status()

    def remove(self, run_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stop run `run_id` (running, stopped or failed): its loop ends (its requests in flight aborted,
        its groups pushed or counted as dropped), its share of the engine is free at once, its adapters
        leave the engine; its buffer keeps what it holds. Its last status: the versions it served, its
        error if it failed, with state `removed`."""
        with self._lock:
            run = self._get(run_id)
            del self._runs[run_id]
        run.stop.set()
        self._join(run, timeout_s)
        last = run.status()  # its loop ended: what it served last, before its adapters leave the engine
        if self.engine.kind == "lora":
            self.engine.call(self.engine.drop_run(run_id))
        run.actor.close()
        log.info("run %s removed from the pool (%d runs)", run_id, len(self._runs))
        return last | {"state": "removed"}

    # --- the service's view

    def runs(self) -> list[Run]:
        """The runs served now, in the order they were added."""
        with self._lock:
            return list(self._runs.values())

    def run(self, run_id: str) -> Run:
        """Run `run_id`; `RunNotFound` when the pool serves none of that id."""
        with self._lock:
            return self._get(run_id)

    def _get(self, run_id: str) -> Run:
        run = self._runs.get(run_id)
        if run is None:
            raise RunNotFound(f"this actor pool serves no run {run_id!r} (GET /v1/runs lists them)")
        return run

    @staticmethod
    def _join(run: Run, timeout_s: float) -> None:
        if run.thread is not None and run.thread.is_alive():
            run.thread.join(timeout_s)
            if run.thread.is_alive():
                log.error("run %s: its loop did not stop within %.0f s", run.run_id, timeout_s)
