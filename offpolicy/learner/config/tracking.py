"""The learner's experiment trackers' settings (`tracking` of learner/config.py; learner/tracking/)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from offpolicy.config.base import FROZEN, ConfigModel, IdStr, PathStr


def require_package(module: str, extra: str) -> None:
    """Raise (a field error where a validator calls it) when `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"needs the `{module}` package: pip install 'offpolicy[{extra}]'")


class WandbConfig(ConfigModel):
    """A Weights & Biases run per learner process (learner/tracking/wandb_sink.py)."""

    project: IdStr
    """W&B project the run goes to."""
    mode: Literal["auto", "offline", "online"] = "auto"
    """`offline` writes the run under `dir` only (`wandb sync` uploads it later); `online` streams it to
    the W&B server (needs `WANDB_API_KEY` in the learner's environment); `auto`: online when
    `WANDB_API_KEY` is set in the learner's environment, else offline (`resolved_mode`)."""
    dir: PathStr | None = None
    """Folder W&B writes its `wandb/` run folders into; None = the working directory."""
    run_name: IdStr | None = None
    """Display name of the run; None = the learner's `run_id`."""

    @model_validator(mode="after")
    def _installed(self) -> Self:
        require_package("wandb", "wandb")
        return self

    def resolved_mode(self, env: Mapping[str, str] = os.environ) -> Literal["offline", "online"]:
        """The mode the run starts in: `auto` is online with a `WANDB_API_KEY` in `env`, else offline."""
        if self.mode != "auto":
            return self.mode
        return "online" if env.get("WANDB_API_KEY") else "offline"


class MlflowConfig(ConfigModel):
    """An MLflow run per learner process (learner/tracking/mlflow_sink.py)."""

    tracking_uri: str = Field(min_length=1)
    """MLflow tracking server or store: `http://mlflow:5000`, or a local `sqlite:///runs/mlflow.db`
    (MLflow 3 refuses a `file:` store unless `MLFLOW_ALLOW_FILE_STORE=true` is set)."""
    experiment: IdStr = "offpolicy"
    """Experiment the run goes to (created when missing)."""
    artifact_location: str | None = Field(None, min_length=1)
    """Where an experiment created by the learner keeps its artifacts (config records, samples), e.g.
    `file:runs/mlflow-artifacts` or `s3://bucket/mlflow`; None = the store's default (for a local
    `sqlite:` store that is `./mlruns` in the learner's working directory). An existing experiment keeps
    its own."""
    run_name: IdStr | None = None
    """Display name of the run; None = the learner's `run_id`."""

    @model_validator(mode="after")
    def _installed(self) -> Self:
        require_package("mlflow", "mlflow")
        return self


class TrackingConfig(ConfigModel):
    """Experiment trackers beside `metrics_jsonl` (learner/tracking/): chosen at start, rank 0 only. A
    tracker that fails is logged once and counted (`offpolicy_learner_tracking_errors_total{sink}`); the
    step goes on."""

    tensorboard_dir: PathStr | None = Field(None, json_schema_extra=FROZEN)
    """Folder of TensorBoard event files (`tensorboard --logdir` it); None = no TensorBoard."""
    wandb: WandbConfig | None = Field(None, json_schema_extra=FROZEN)
    """Weights & Biases run settings; None = no W&B."""
    mlflow: MlflowConfig | None = Field(None, json_schema_extra=FROZEN)
    """MLflow run settings; None = no MLflow."""
    samples_per_version: int = Field(4, ge=0, le=256)
    """Completions (prompt, completion, reward) decoded and logged as a table per policy version, at most
    once per version (the newest version among a step's groups); 0 = none."""

    @field_validator("tensorboard_dir")
    @classmethod
    def _tensorboard_installed(cls, value: str | None) -> str | None:
        if value is not None:
            require_package("tensorboard", "tensorboard")
        return value
