"""TensorBoard event files (`tracking.tensorboard_dir`) through `torch.utils.tensorboard`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from offpolicy.learner.tracking.sink import MetricsSink, markdown_table, scalars


class TensorBoardSink(MetricsSink):
    """Step metrics as scalars at the learner step, `eval/...` scalars at the policy version, the config
    as text (tag `config`) at the step it took effect, samples as a Markdown table (tag `samples`) at
    their policy version. Flushed after every step, so `tensorboard --logdir` follows a running learner."""

    name = "tensorboard"

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.writer = SummaryWriter(log_dir=log_dir)

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=version)
        self.writer.flush()

    def log_config(self, config: Mapping[str, Any], source: str, config_version: int, step: int) -> None:
        body = json.dumps(config, indent=2, sort_keys=True)
        text = f"config_version {config_version} ({source}) from step {step + 1}:\n\n```\n{body}\n```"
        self.writer.add_text("config", text, global_step=step)
        self.writer.flush()

    def log_samples(self, version: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("samples", markdown_table(rows), global_step=version)

    def close(self) -> None:
        self.writer.close()
