"""The actor service: `create_app(settings)` builds the FastAPI app; `serve()` runs it under uvicorn."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from offpolicy.actors.rollout.pool import ActorFactory, build_actor
from offpolicy.services.actor_api import routes
from offpolicy.services.actor_api.runtime import ActorRuntime
from offpolicy.services.common.app import create_runtime_app, serve_app
from offpolicy.services.common.metrics import make_registry
from offpolicy.services.common.settings import ActorServiceSettings

DESCRIPTION = """An offpolicy actor: vLLM generation into the replay buffer, reloading published weights.

Serves liveness, readiness (Redis reachable, engine loaded, loop running), Prometheus metrics and its
status. One engine may serve several runs on its base model as LoRA adapters (an actor pool): `/v1/runs`
lists, adds, changes and removes them (the changes need the bearer token when one is configured).
With `gateway.enabled` it also serves the OpenAI-compatible gateway for agents written elsewhere:
`POST /v1/episodes` opens an episode, `POST /v1/chat/completions` with `X-Episode-Id` records each call,
`POST /v1/episodes/{episode_id}/finish` closes it (docs/agents.md); these need the gateway's bearer token
(`OFFPOLICY_GATEWAY_TOKEN`, the `openai` client's `api_key`) when one is configured, else the API token.
"""


def create_app(
    settings: ActorServiceSettings | None = None,
    *,
    config: Any = None,
    actor_factory: ActorFactory = build_actor,
    engine: Any = None,
) -> FastAPI:
    """The actor app; `config` defaults to `settings.config_path` (+ `OFFPOLICY_*` overrides): the pool's
    first run and its `runs`. `actor_factory(config, registry, engine)` builds each run's actor; `engine`:
    an engine to share (tests; not stopped with the app), None = the pool builds one at start."""
    settings = settings or ActorServiceSettings.from_env(os.environ)
    if config is None:
        from offpolicy.actors.config import load_config

        config = load_config(settings.config_path, os.environ)
    registry = make_registry({"run_id": config.run_id})  # the process's samples; each run's carry its own
    runtime = ActorRuntime(config, registry, actor_factory, engine)
    return create_runtime_app(
        title="offpolicy actor",
        description=DESCRIPTION,
        settings=settings,
        registry=registry,
        runtime=runtime,
        component="actor",
        redis_url=config.redis_url,
        router=routes.router,
        redactor=runtime.redactor,
    )


def serve(**overrides: Any) -> int:
    """Run the actor service in this process until SIGTERM / Ctrl-C (settings: env, then `overrides`)."""
    return serve_app(ActorServiceSettings.from_env(os.environ, **overrides), create_app)
