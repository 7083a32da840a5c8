"""An MLflow run (`tracking.mlflow`) through an explicit `MlflowClient` (no global active run)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from offpolicy.learner.config.tracking import MlflowConfig
from offpolicy.learner.tracking.sink import SAMPLE_COLUMNS, MetricsSink, flatten, scalars

BATCH = 1000  # MLflow's limit of metrics per log_batch call
PARAMS_BATCH = 100  # ... and of params
PARAM_CHARS = 500  # a param value is cut to this many characters


class MlflowSink(MetricsSink):
    """Step metrics at MLflow step = learner step; `eval/...` at step = policy version; the first config
    also as params (dotted keys); every config as a JSON artifact `config/v<config_version>-<source>.json`;
    samples as `samples/v<version>.json` (`{"columns", "data"}`, MLflow's table layout)."""

    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, run_id: str) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient(cfg.tracking_uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            experiment_id = self.client.create_experiment(cfg.experiment, cfg.artifact_location)
        else:
            experiment_id = experiment.experiment_id
        run = self.client.create_run(
            experiment_id, run_name=cfg.run_name or run_id, tags={"offpolicy.run_id": run_id}
        )
        self.run_id = run.info.run_id
        self._params_logged = False

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + BATCH])

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._metrics(scalars(metrics), step)

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        self._metrics(scalars(metrics), version)

    def log_config(self, config: Mapping[str, Any], source: str, config_version: int, step: int) -> None:
        record = {"config_version": config_version, "source": source, "applied_at_step": step}
        record["config"] = config
        self.client.log_dict(self.run_id, record, f"config/v{config_version:04d}-{source}.json")
        if not self._params_logged:  # params cannot change in MLflow: the config the run started with
            from mlflow.entities import Param

            params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in flatten(config).items()]
            for i in range(0, len(params), PARAMS_BATCH):
                self.client.log_batch(self.run_id, params=params[i : i + PARAMS_BATCH])
            self._params_logged = True

    def log_samples(self, version: int, rows: list[dict[str, Any]]) -> None:
        table = {"columns": list(SAMPLE_COLUMNS), "data": [[r[c] for c in SAMPLE_COLUMNS] for r in rows]}
        self.client.log_dict(self.run_id, table, f"samples/v{version:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
