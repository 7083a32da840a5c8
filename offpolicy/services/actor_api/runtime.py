"""The actor service's domain side: builds the `Actor` (and its vLLM engine), hosts its loop thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry

from offpolicy.config.secrets import Redactor, url_secrets
from offpolicy.services.actor_api.schemas import ActorStatus
from offpolicy.services.common.errors import NotFound, NotReady
from offpolicy.services.common.loop import BackgroundLoop, FailureHook

log = logging.getLogger(__name__)
T = TypeVar("T")


class ActorLike(Protocol):
    """What the service calls on `offpolicy.actors.rollout.loop.Actor` (docs/architecture.md)."""

    def run(self, stop_event: Any) -> Any: ...
    def status(self) -> Any: ...
    def close(self) -> None: ...


ActorFactory = Callable[[Any, CollectorRegistry], ActorLike]


class ActorRuntime:
    """One actor and its loop thread; built and started by the app's lifespan (in the main thread, since
    vLLM's engine start-up installs signal handlers and spawns workers)."""

    def __init__(self, config: Any, registry: CollectorRegistry, factory: ActorFactory) -> None:
        self.config = config
        self.registry = registry
        self._factory = factory
        self.actor: ActorLike | None = None
        self.loop: BackgroundLoop | None = None
        self.redactor = Redactor(url_secrets(config.redis_url))
        """The secrets of the config (Redis password): no status, readiness reason or log shows them."""

    def start(self, on_failure: FailureHook | None = None) -> None:
        """Build the actor (starts the engine) and its loop; `on_failure` is called if the loop dies."""
        self.actor = self._factory(self.config, self.registry)
        self.loop = BackgroundLoop(self.actor.run, "actor", on_failure)
        self.loop.start()
        log.info("actor loop started")

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.loop is not None and not self.loop.stop(timeout_s):
            log.error("actor loop did not stop within %.0f s", timeout_s)
        if self.actor is not None:
            self.actor.close()  # the vLLM engine-core process is ours to stop

    def gateway(self) -> Any:
        """The actor's gateway (`offpolicy.actors.gateway.episodes.Gateway`); `NotFound` when disabled,
        `NotReady` while the
        actor starts."""
        if not self.config.gateway.enabled:
            raise NotFound("the gateway is not enabled on this actor (gateway.enabled)")
        if self.actor is None or getattr(self.actor, "gateway", None) is None:
            raise NotReady("the actor is still starting (loading the engine)")
        return self.actor.gateway

    async def on_engine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's event loop (where the actor and its gateway live)."""
        return await self.actor.engine.acall(coro)  # type: ignore[union-attr]

    def readiness(self) -> str | None:
        if self.actor is None or self.loop is None:
            return "the actor is still starting (loading the engine)"
        reason = self.loop.readiness()
        return None if reason is None else self.redactor.scrub(reason)

    def liveness(self) -> str | None:
        """None while the loop lives (or ended on its own); why it died otherwise (`/healthz` 503)."""
        reason = self.loop.failure() if self.loop is not None else None
        return None if reason is None else self.redactor.scrub(reason)

    def status(self) -> ActorStatus:
        if self.actor is None:
            return ActorStatus(
                state="starting",
                actor_id="",
                loaded_policy_version=None,
                learner_policy_version=None,
                tokens_per_s=None,
                groups_pushed=0,
                reloads=0,
            )
        raw = dict(self.actor.status())
        error = None
        if self.loop is not None and self.loop.error is not None:
            error = self.redactor.scrub(f"{type(self.loop.error).__name__}: {self.loop.error}")
            raw["state"] = "failed"
        return ActorStatus(**{k: v for k, v in raw.items() if k in ActorStatus.model_fields}, error=error)
