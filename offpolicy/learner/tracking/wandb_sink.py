"""A Weights & Biases run (`tracking.wandb`): offline (a run folder for `wandb sync`) or online."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offpolicy.learner.config.tracking import WandbConfig
from offpolicy.learner.tracking.sink import SAMPLE_COLUMNS, MetricsSink, scalars


class WandbSink(MetricsSink):
    """Step metrics at W&B step = learner step; `eval/...` against `eval/policy_version` (merged into the
    last step's row: W&B steps only move forward); the running config as the run's config with its
    `config_source` and `config_version`, every change also a row of the `config/changes` table; samples as
    a `samples` table."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_id: str) -> None:
        import wandb

        self._wandb = wandb
        if cfg.dir is not None:
            Path(cfg.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.run_name or run_id,
            mode=cfg.resolved_mode(),
            dir=cfg.dir,
            tags=[f"run_id:{run_id}"],
            reinit="create_new",  # a run per learner, also when tests start several in one process
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("eval/*", step_metric="eval/policy_version")
        self._step = 0
        self._changes: list[list[Any]] = []

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._step = step
        self.run.log(scalars(metrics), step=step)

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        self.run.log(scalars(metrics) | {"eval/policy_version": version}, step=self._step)

    def log_config(self, config: Mapping[str, Any], source: str, config_version: int, step: int) -> None:
        update = {"learner": dict(config), "config_source": source, "config_version": config_version}
        self.run.config.update(update, allow_val_change=True)
        self._changes.append([config_version, source, step])
        table = self._wandb.Table(columns=["config_version", "source", "applied_at_step"], data=self._changes)
        self.run.log({"config/changes": table}, step=max(step, self._step))

    def log_samples(self, version: int, rows: list[dict[str, Any]]) -> None:
        data = [[r[c] for c in SAMPLE_COLUMNS] for r in rows]
        self.run.log({"samples": self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=data)}, step=self._step)

    def close(self) -> None:
        self.run.finish()
