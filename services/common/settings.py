"""Service settings from the environment (pydantic-settings), built by the app factories, never at import."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from config.base import MAX_STR


class ServiceSettings(BaseSettings):
    """Settings every service process shares; read from `OFFPOLICY_*` environment variables."""

    model_config = SettingsConfigDict(
        env_prefix="OFFPOLICY_", extra="ignore", frozen=True, allow_inf_nan=False, str_max_length=MAX_STR
    )

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
