"""The actor service's domain side: hosts the actor pool (its engine, its runs' actors and loop threads).

It adds, changes and removes runs for the routes, and says when the service is dead: every run's loop
failed (one run's death is that run's)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError

from offpolicy.actors.config import ActorConfig
from offpolicy.actors.config.pool import INHERITED_FIELDS
from offpolicy.actors.rollout.pool import ActorFactory, Pool, Run, build_actor
from offpolicy.config.secrets import Redactor, url_secrets
from offpolicy.services.actor_api.schemas import ActorStatus, RunList, RunStatus
from offpolicy.services.common.background import FailureHook
from offpolicy.services.common.errors import InvalidConfig, NotFound, NotReady, field_errors
from offpolicy.services.common.metrics import MergedRegistries, ServiceRegistry, make_registry

log = logging.getLogger(__name__)
T = TypeVar("T")


class ActorRuntime:
    """The actor's pool; built and started by the app's lifespan (in the main thread, since vLLM's engine
    start-up installs signal handlers and spawns workers). `config` is the pool's (its first run, and
    `runs`); `engine`: an engine to share (tests), None = the pool builds one. Each run's metrics are on a
    registry of its own, labelled with its run id, exported with the service's `registry`."""

    def __init__(
        self,
        config: ActorConfig,
        registry: ServiceRegistry,
        actor_factory: ActorFactory = build_actor,
        engine: Any = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self._factory, self._engine = actor_factory, engine
        self.pool: Pool | None = None
        self.redactor = Redactor(s for run in (config, *config.runs) for s in url_secrets(run.redis_url))
        """The secrets of the runs' configs (Redis passwords): no status, readiness reason or log shows
        them."""
        registry.register(MergedRegistries(self._run_registries))  # type: ignore[arg-type]
        self._started = False
        self._fatal: FailureHook | None = None
        self._dead: str | None = None  # why the service is dead: every run's loop failed
        self._dead_lock = threading.Lock()

    # --- life cycle

    def start(self, on_failure: FailureHook | None = None) -> None:
        """Build the pool's engine and start its runs; `on_failure` is called once every run's loop died."""
        self._fatal = on_failure
        self.pool = Pool(
            self.config,
            lambda run_id: make_registry({"run_id": run_id}, process_collectors=False),
            engine=self._engine,
            actor_factory=self._factory,
            on_failure=lambda run_id, exc: self._check_dead() if self._started else None,
        )
        try:
            self.pool.start()
        except BaseException:
            self.pool.close()
            raise
        self._started = True
        self._check_dead()  # a run that died while the others started
        log.info("actor pool started: %s", ", ".join(r.run_id for r in self.pool.runs()))

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.pool is not None:
            self.pool.close(timeout_s)

    def _check_dead(self) -> None:
        """Once every run's loop has failed, the service is dead: `on_failure` (the exit after the grace),
        then `/healthz` answers 503 with the reason."""
        with self._dead_lock:
            runs = self._pool().runs()
            if self._dead is not None or not runs or any(r.error is None for r in runs):
                return
            if len(runs) == 1:
                reason = f"actor loop failed: {_describe(runs[0])}"
            else:
                reason = "every run's loop failed: " + "; ".join(f"{r.run_id}: {_describe(r)}" for r in runs)
            if self._fatal is not None:
                self._fatal(runs[-1].error)  # type: ignore[arg-type]
            self._dead = reason

    # --- health

    def readiness(self) -> str | None:
        if self.pool is None or not self._started:
            return "the actor is still starting (loading the engine)"
        if self._dead is not None:
            return self.redactor.scrub(self._dead)
        return None if self.pool.engine.alive else "the actor's engine is dead"

    def liveness(self) -> str | None:
        """None while a run's loop lives (or ended on its own); why they all died otherwise (`/healthz`)."""
        return None if self._dead is None else self.redactor.scrub(self._dead)

    # --- status and runs

    def status(self) -> ActorStatus:
        """The first run's status, with every run's state."""
        runs = [] if self.pool is None else self.pool.runs()
        if not runs:
            return ActorStatus(
                state="starting" if self.pool is None or not self._started else "idle",
                actor_id="",
                loaded_policy_version=None,
                learner_policy_version=None,
                tokens_per_s=None,
                groups_pushed=0,
                reloads=0,
            )
        first = self._run_status(runs[0])
        failed = {r.run_id: self.redactor.scrub(_describe(r)) for r in runs if r.error is not None}
        states = {"runs": {r.run_id: r.state for r in runs}, "failed_runs": failed}
        return ActorStatus(**(_fields(first, ActorStatus) | states))

    def runs(self) -> RunList:
        return RunList(runs=[self._run_status(r) for r in self._pool().runs()])

    def add_run(self, body: dict[str, Any]) -> RunStatus:
        """Validate a run's config (`model_path`, `engine` and `redis_url` default to the pool's) and add
        it."""
        if body.get("runs"):
            detail = [{"field": "body.runs", "message": "a pool's run has no runs", "type": "value_error"}]
            raise InvalidConfig("a run's config has no `runs`", detail)
        pool = self.config.model_dump(include=set(INHERITED_FIELDS))
        config = _validated(lambda: ActorConfig.model_validate(pool | body))
        self.redactor.add(*url_secrets(config.redis_url))
        return self._status_of(self._pool().add(config))

    def update_run(self, run_id: str, patch: dict[str, Any]) -> RunStatus:
        return self._status_of(_validated(lambda: self._pool().update(run_id, patch)))

    def remove_run(self, run_id: str) -> RunStatus:
        return self._status_of(self._pool().remove(run_id))

    # --- the gateway

    def gateway(self, run_id: str | None = None) -> Any:
        """The gateway of run `run_id` (None: the first run's), an `actors.gateway.agent_episodes.Gateway`;
        `NotFound` when that run has it disabled, `NotReady` while the actor starts."""
        if self.pool is None or not self._started:
            raise NotReady("the actor is still starting (loading the engine)")
        runs = self.pool.runs()
        if run_id is not None:
            run = self.pool.run(run_id)
        elif runs:
            run = runs[0]
        else:
            raise NotFound("this actor serves no run (POST /v1/runs adds one)")
        if not run.config.gateway.enabled:
            raise NotFound(f"the gateway is not enabled on run {run.run_id!r} (gateway.enabled)")
        return run.actor.gateway  # type: ignore[attr-defined]

    def gateway_of(self, episode_id: str | None) -> Any:
        """The gateway that holds episode `episode_id` (the first run's when none does: it answers 404)."""
        for run in self._pool().runs():
            if run.config.gateway.enabled and run.actor.gateway.holds(episode_id):  # type: ignore[attr-defined]
                return run.actor.gateway  # type: ignore[attr-defined]
        return self.gateway()

    async def on_engine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's event loop (where the actors and their gateways live)."""
        return await self._pool().engine.acall(coro)

    # --- helpers

    def _pool(self) -> Pool:
        if self.pool is None:
            raise NotReady("the actor is still starting (loading the engine)")
        return self.pool

    def _run_registries(self) -> list[Any]:
        return [] if self.pool is None else [r.registry for r in self.pool.runs()]

    def _run_status(self, run: Run) -> RunStatus:
        return self._status_of(run.status())

    def _status_of(self, raw: dict[str, Any]) -> RunStatus:
        if raw.get("error") is not None:
            raw = raw | {"error": self.redactor.scrub(raw["error"])}
        return RunStatus(**_fields(raw, RunStatus))


def _describe(run: Run) -> str:
    return f"{type(run.error).__name__}: {run.error}"


def _fields(raw: Any, model: type[ActorStatus]) -> dict[str, Any]:
    """The keys of `raw` that `model` has (an actor's status carries more than the API shows)."""
    data = raw.model_dump() if isinstance(raw, ActorStatus) else raw
    return {k: v for k, v in data.items() if k in model.model_fields}


def _validated(build: Callable[[], T]) -> T:
    """`build()`, its pydantic errors as a 422 naming each field under `body.`."""
    try:
        return build()
    except ValidationError as e:
        detail = field_errors(e.errors(include_url=False), ("body",))
        raise InvalidConfig(f"{e.error_count()} invalid field(s) in the run's config", detail) from e
