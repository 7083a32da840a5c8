"""Service process settings (`ConfigModel`s), loaded by the one loader from `OFFPOLICY_*` variables.

`ServiceSettings.from_env(os.environ, **overrides)` is how the app factories and `serve()` build them
(`offpolicy.config.loader.load_layered`: the environment mapping passed in, then the command line's
overrides);
constructing one directly reads nothing. Nothing reads the environment at import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, SecretStr

from offpolicy.config.base import MAX_STR, ConfigModel
from offpolicy.config.loader import load_layered


class ServiceSettings(ConfigModel):
    """Settings every service process shares; `OFFPOLICY_<FIELD>` in the environment (`from_env`)."""

    api_token: SecretStr | None = Field(None, min_length=1, max_length=MAX_STR)
    """Bearer token that mutating routes require (`OFFPOLICY_API_TOKEN`); None = no authentication."""

    host: str = Field("127.0.0.1", min_length=1, max_length=255)
    """Interface uvicorn binds to."""

    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port uvicorn listens on; 0 = any free port."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Level of the structured JSON logs on stderr."""

    log_json: bool = True
    """True = one JSON object per log line; False = plain text (for humans at a terminal)."""

    redis_ping_timeout_s: float = Field(default=1.0, gt=0)
    """Seconds `/readyz` waits for Redis to answer PING before calling it unreachable."""

    fatal_exit_grace_s: float = Field(default=30.0, ge=0)
    """Seconds between the death of the service's loop (any error it does not retry by itself) and the
    process exiting non-zero (`OFFPOLICY_FATAL_EXIT_GRACE_S`); `/healthz` answers 503 meanwhile."""

    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Largest request body accepted, in bytes (`OFFPOLICY_MAX_BODY_BYTES`); a larger one answers 413."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> Self:
        """The `OFFPOLICY_*` variables of `environ` naming this model's fields, then `overrides`."""
        return load_layered(cls, None, environ, overrides)


class LearnerServiceSettings(ServiceSettings):
    """Settings of the learner service process (`offpolicy learner`)."""

    config_path: Path | None = None
    """YAML file with the `LearnerConfig` to start from (`OFFPOLICY_CONFIG_PATH`); None = the defaults."""

    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port of the learner's control plane."""


class ActorServiceSettings(ServiceSettings):
    """Settings of the actor service process (`offpolicy actor`)."""

    config_path: Path | None = None
    """YAML file with the `ActorConfig` to run (`OFFPOLICY_CONFIG_PATH`); None = the defaults."""

    port: int = Field(default=8001, ge=0, le=65535)
    """TCP port of the actor's health, metrics and status routes."""

    gateway_token: SecretStr | None = Field(None, min_length=1, max_length=MAX_STR)
    """Bearer token of the gateway's routes (`OFFPOLICY_GATEWAY_TOKEN`: the agents' `api_key`), apart from
    the learner's admin token so that an agent cannot change the learner; None = `api_token` guards them."""
