"""Experiment tracking: one `MetricsSink` interface, one file per backend (JSONL, TensorBoard, W&B, MLflow),
the `Tracker` the learner calls, and `StepLog`: an applied step's line for the trackers and Prometheus."""

from offpolicy.learner.tracking.sink import SAMPLE_COLUMNS, MetricsSink
from offpolicy.learner.tracking.step_log import StepLog
from offpolicy.learner.tracking.tracker import Tracker, build_tracker, sample_rows

__all__ = ["SAMPLE_COLUMNS", "MetricsSink", "StepLog", "Tracker", "build_tracker", "sample_rows"]
