"""Experiment tracking: one `MetricsSink` interface, one file per backend (JSONL, TensorBoard, W&B, MLflow),
and the `Tracker` the learner calls."""

from learner.tracking.sink import SAMPLE_COLUMNS, MetricsSink
from learner.tracking.tracker import Tracker, build_tracker, sample_rows

__all__ = ["SAMPLE_COLUMNS", "MetricsSink", "Tracker", "build_tracker", "sample_rows"]
