"""A tracker sink of your own: a `MetricsSink` that keeps a few step metrics as CSV (docs/extend.md
"A tracker sink").

A sink implements what it keeps of `offpolicy.learner.tracking.sink.MetricsSink` (`log_step`, `log_eval`,
`log_config`, `log_samples`, `close`; the others do nothing) and is called by the learner's `Tracker` on
rank 0's loop thread, which fans every call out to all sinks and isolates them: a sink that raises is
logged once and counted in `offpolicy_learner_tracking_errors_total{sink}`; the step goes on.

The learner chooses its sinks once, from the `tracking:` section (`build_tracker`: the JSONL file always,
TensorBoard, W&B, MLflow when configured): there is no setting that names a class of yours. To ship a sink
with the learner service, add it to the package (docs/extend.md lists the four places). This file runs
the sink under the learner's own `Tracker` and metrics, as `build_tracker` would once it is listed there.

    python examples/extend/my_sink.py        # three steps through the Tracker into a CSV and the JSONL file
"""

from __future__ import annotations

import csv
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offpolicy.learner.tracking.sink import MetricsSink, scalars

COLUMNS = ("step", "reward_mean", "loss", "grad_norm", "rollout_corr/rollout_is_mean")


class CsvSink(MetricsSink):
    """One CSV row per learner step with `COLUMNS` (empty where a step has no finite value)."""

    name = "csv"  # the `sink` label of offpolicy_learner_tracking_errors_total

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", newline="")
        self._writer = csv.writer(self._file)
        if self.path.stat().st_size == 0:
            self._writer.writerow(COLUMNS)

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = scalars(metrics) | {"step": step}  # finite numbers only: NaN, inf and lists left out
        self._writer.writerow([values.get(c, "") for c in COLUMNS])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class BrokenSink(MetricsSink):
    """A sink whose every step fails (a tracker server that is down): the steps must go on."""

    name = "broken"

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        raise ConnectionError("tracker server unreachable")


def demo(folder: str | Path) -> tuple[list[dict[str, str]], float]:
    """Three steps through the learner's `Tracker` into the JSONL file, a `CsvSink` and a `BrokenSink`:
    the CSV rows, and how many failures `offpolicy_learner_tracking_errors_total{sink="broken"}` counted."""
    from prometheus_client import CollectorRegistry

    from offpolicy.learner.metrics import LearnerMetrics
    from offpolicy.learner.tracking import Tracker
    from offpolicy.learner.tracking.jsonl_sink import JsonlSink

    folder = Path(folder)
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    sinks = [JsonlSink(str(folder / "metrics.jsonl")), CsvSink(folder / "steps.csv"), BrokenSink()]
    tracker = Tracker(sinks, metrics.tracking_errors)
    for step in (1, 2, 3):
        line = {"reward_mean": step / 4, "loss": 1.0 / step, "grad_norm": float("nan"), "tokens": 512.0}
        tracker.log_step(step, line, groups=[])  # what the learner calls once a step's update is applied
    tracker.close()
    with (folder / "steps.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    failures = registry.get_sample_value("offpolicy_learner_tracking_errors_total", {"sink": "broken"})
    return rows, failures or 0.0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        rows, failures = demo(folder)
        for row in rows:
            print(row)
        print("broken sink failures counted:", failures)
