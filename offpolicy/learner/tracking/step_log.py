"""What a step leaves behind once its update is applied: its metrics line and its Prometheus record.

`StepLog.record` is called for every step whose update was applied (even when what follows it, the ack,
the publish or a background write, fails): it adds throughput, the step's counters and phase times, the
reward per `data_source` with the extra figures a verl reward returned (`reward/<source>/mean`,
`reward/<source>/acc`: `by_source`), and the newest evaluation an evaluating actor recorded since the last
step (`eval/...`), then hands the line
to the trackers (metrics.jsonl, TensorBoard, W&B, MLflow) before the Prometheus gauges move, so that a
scrape never shows a step the metrics file does not have.
"""

from __future__ import annotations

import logging
import math

from offpolicy.buffer.errors import StorageUnavailable
from offpolicy.buffer.evaluations import EvalStore
from offpolicy.buffer.types import REWARD_EXTRA_PREFIX
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.tracking.tracker import Tracker

log = logging.getLogger(__name__)


def by_source(groups: list) -> dict[str, float]:
    """The step's reward per `data_source` (a group's metadata, as verl's parquet gives it): the mean over
    its completions, and each extra figure its reward returned (`reward_extra/<key>` of the group's
    metadata) as the mean over its groups; every group counts under `all` too. A figure that is not a
    finite number (a group posted over HTTP may carry any text) is left out."""
    rewards: dict[str, list[float]] = {}
    figures: dict[str, dict[str, list[float]]] = {}
    for g in groups:
        source = g.metadata.get("data_source")
        for name in ["all"] if source is None else ["all", source]:
            rewards.setdefault(name, []).extend(t.reward for t in g.trajectories)
            mine = figures.setdefault(name, {})
            for key, raw in g.metadata.items():
                if key.startswith(REWARD_EXTRA_PREFIX) and (value := _finite(raw)) is not None:
                    mine.setdefault(key[len(REWARD_EXTRA_PREFIX) :], []).append(value)
    if len(rewards) < 2 and not any(figures.values()):  # no source, no extra figure: reward_mean is all
        return {}
    out = {}
    for name, values in rewards.items():
        out[f"reward/{name}/mean"] = sum(values) / len(values)
        out |= {f"reward/{name}/{key}": sum(v) / len(v) for key, v in figures[name].items()}
    return out


def _finite(raw: str) -> float | None:
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class StepLog:
    """The metrics line and Prometheus record of each applied step; the evaluation stream's cursor.

    `evals` is the leader's evaluation stream (None on followers: nothing to read)."""

    def __init__(self, tracker: Tracker, metrics: LearnerMetrics, evals: EvalStore | None) -> None:
        self.tracker, self.metrics, self.evals = tracker, metrics, evals
        self.tokens_per_s: float | None = None
        """The last applied step's trained tokens per second of its phases (None before the first)."""
        self._eval_after = self._latest_evaluation()  # evaluations from before this start are old

    def record(
        self,
        metrics: dict[str, float],
        phases: dict[str, float],
        groups: list,
        counters: dict[str, float],
    ) -> dict[str, float]:
        """The line of an applied step: `metrics` (the update's) with throughput, `counters` (step,
        config version, published lag), `time/<phase>` and any new evaluation; logged, then recorded."""
        total = sum(phases.values())
        self.tokens_per_s = metrics["tokens"] / total if total > 0 else None
        metrics |= {"tokens_per_s": self.tokens_per_s or 0.0, **counters}
        metrics |= {f"time/{k}": v for k, v in phases.items()}
        metrics |= by_source(groups)
        evaluation = self._new_evaluation()  # an evaluating actor's newest, on this step's line
        metrics |= evaluation
        self.tracker.log_step(int(counters["step"]), metrics, groups)  # before the metrics are visible
        if evaluation:
            self.tracker.log_eval(int(evaluation["eval/policy_version"]), evaluation)
        self.metrics.record_step(metrics, phases)
        return metrics

    def _latest_evaluation(self) -> str | None:
        """The id of the newest evaluation in the stream now (None: not known yet, Redis unreachable)."""
        try:
            return None if self.evals is None else self.evals.latest_id()
        except StorageUnavailable:
            return None

    def _new_evaluation(self) -> dict[str, float]:
        """The newest evaluation an evaluating actor recorded since the last step, as `eval/...` metrics
        (none: {}); an unreachable stream costs this step its evaluation line, nothing else."""
        if self.evals is None:
            return {}
        try:
            if self._eval_after is None:
                self._eval_after = self.evals.latest_id()
            new = self.evals.after(self._eval_after)
        except StorageUnavailable as e:
            log.warning("evaluations not read this step: %s", e)
            return {}
        if not new:
            return {}
        self._eval_after = new[-1][0]
        return new[-1][1].metrics()
