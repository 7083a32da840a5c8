"""The per-step JSONL file (`metrics_jsonl`): one JSON line per step, NaN and infinities as null."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offpolicy.learner.metrics import json_safe
from offpolicy.learner.tracking.sink import MetricsSink


class JsonlSink(MetricsSink):
    """Appends each step's metrics (and its `group_ids`) to `path`; steps only (readers take every line
    for a step). `path` follows the running config's `metrics_jsonl`; None writes nothing."""

    name = "jsonl"

    def __init__(self, path: str | None) -> None:
        self.path = path

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.path is not None:
            append_jsonl(Path(self.path), json_safe(metrics))

    def log_config(self, config: Mapping[str, Any], source: str, config_version: int, step: int) -> None:
        self.path = config["metrics_jsonl"]


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append `record`, stamped with the wall time, as one JSON line to `path` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps({"time": time.time(), **record}) + "\n")
