"""The learner service: `create_app(settings)` builds the FastAPI app; `serve()` runs it under uvicorn."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from offpolicy.config.secrets import Redactor, url_secrets
from offpolicy.learner.config import LearnerConfig, load_config
from offpolicy.services.common.app import create_runtime_app, serve_app
from offpolicy.services.common.logging import configure_logging
from offpolicy.services.common.metrics import make_registry
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api import routes
from offpolicy.services.learner_api.runtime import ConfigApplied, LearnerFactory, LearnerRuntime

DESCRIPTION = """Control plane of the offpolicy learner.

Config changes (PUT replaces, PATCH merges) are validated, refused with 409 when they touch a field that
cannot change while running (the model, the Redis run, the weights folder), and applied at the next step
boundary with a new `config_version`. Mutating routes need `Authorization: Bearer <token>` when the
service runs with `OFFPOLICY_API_TOKEN`. Errors are `{"error": {"code", "message", "detail"}}`.
"""


def _default_factory(config: LearnerConfig, registry: Any, on_config_applied: ConfigApplied):
    from offpolicy.learner.trainer import Learner

    return Learner(config, registry, on_config_applied)


def create_app(
    settings: LearnerServiceSettings | None = None,
    *,
    config: LearnerConfig | None = None,
    learner_factory: LearnerFactory | None = None,
) -> FastAPI:
    """The learner app; `config` defaults to `settings.config_path` (+ `OFFPOLICY_*` overrides)."""
    settings = settings or LearnerServiceSettings.from_env(os.environ)
    if config is None:
        config = load_config(settings.config_path, os.environ)
    registry = make_registry({"run_id": config.run_id})  # on every sample /metrics exports
    runtime = LearnerRuntime(config, registry, learner_factory or _default_factory)
    return create_runtime_app(
        title="offpolicy learner",
        description=DESCRIPTION,
        settings=settings,
        registry=registry,
        runtime=runtime,
        component="learner",
        redis_url=config.redis_url,
        router=routes.router,
        redactor=runtime.redactor,
    )


def serve(**overrides: Any) -> int:
    """Run the learner service in this process until SIGTERM / Ctrl-C (settings: env, then `overrides`).

    Under torchrun (`offpolicy learner --nproc-per-node N`) every rank joins the process group; rank 0
    serves the API around the loop, the other ranks run the leader's commands (learner/launch.py)."""
    settings = LearnerServiceSettings.from_env(os.environ, **overrides)
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        from offpolicy.learner.distributed import current
        from offpolicy.learner.launch import join, run_follower

        config = load_config(settings.config_path, os.environ)
        join(config)
        if not current().is_leader:
            redactor = Redactor(url_secrets(config.redis_url))
            configure_logging(settings.log_level, settings.log_json, redactor)
            return run_follower(config)
    return serve_app(settings, create_app)
