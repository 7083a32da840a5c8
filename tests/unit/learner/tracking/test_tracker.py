"""The tracker's contract over scripted sinks: every call fanned out, a sink that raises logged once and
counted while the others go on, eval keys under `eval/`, completions once per policy version, the config
with its secrets masked; a tracker whose package is missing is a field error (422 through the API)."""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.tracking import MetricsSink, Tracker, sample_rows
from offpolicy.learner.tracking.sink import flatten, markdown_table, scalars
from offpolicy.services.common.errors import InvalidConfig
from offpolicy.services.learner_api.control import validate_body
from tests.unit.learner.rl.test_microbatches import ragged_groups


class Recording(MetricsSink):
    name = "jsonl"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def log_step(self, step, metrics):
        self.calls.append(("step", step, dict(metrics)))

    def log_eval(self, version, metrics):
        self.calls.append(("eval", version, dict(metrics)))

    def log_config(self, config, source, config_version, step):
        self.calls.append(("config", source, config_version, step, config))

    def log_samples(self, version, rows):
        self.calls.append(("samples", version, rows))

    def close(self):
        self.calls.append(("close",))


class Broken(MetricsSink):
    name = "wandb"

    def log_step(self, step, metrics):
        raise ConnectionError("the tracking server is gone")

    log_eval = log_config = log_samples = close = lambda self, *a: (_ for _ in ()).throw(OSError("disk full"))


class CharTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def tracker(*sinks: MetricsSink, samples: int = 2) -> tuple[Tracker, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    return Tracker(list(sinks), metrics.tracking_errors, CharTokenizer(), samples), registry


def test_a_sink_that_raises_is_logged_once_counted_and_the_others_go_on(caplog):
    good, broken = Recording(), Broken()
    t, registry = tracker(broken, good)
    groups = ragged_groups(2, 2, seed=1)
    with caplog.at_level(logging.ERROR, logger="offpolicy.learner.tracking.tracker"):
        for step in (1, 2, 3):
            t.log_step(step, {"loss": 0.5}, groups)
        t.log_eval(3, {"accuracy": 1.0})
        t.log_config(LearnerConfig(model_path="/m"), "api", 1, 3)
        t.close()
    assert [c[0] for c in good.calls] == ["step", "samples", "step", "step", "eval", "config", "close"]
    assert (
        registry.get_sample_value("offpolicy_learner_tracking_errors_total", {"sink": "wandb"}) == 7
    )  # 3 steps, a table, eval, config, close
    assert registry.get_sample_value("offpolicy_learner_tracking_errors_total", {"sink": "jsonl"}) == 0
    assert len([r for r in caplog.records if "tracker wandb failed" in r.message]) == 1


def test_steps_carry_the_group_ids_and_eval_keys_get_the_prefix():
    sink = Recording()
    t, _ = tracker(sink, samples=0)
    groups = ragged_groups(2, 2, seed=2)
    t.log_step(1, {"loss": 0.25, "reward_mean": 0.5}, groups)
    t.log_eval(7, {"accuracy": 0.75, "eval/pass@4": 0.5})
    assert sink.calls[0] == (
        "step",
        1,
        {"loss": 0.25, "reward_mean": 0.5, "group_ids": [g.group_id for g in groups]},
    )
    assert sink.calls[1] == ("eval", 7, {"eval/accuracy": 0.75, "eval/pass@4": 0.5})
    assert len(sink.calls) == 2  # samples_per_version 0: no table


def test_completions_are_logged_once_per_policy_version_newest_first():
    sink = Recording()
    t, _ = tracker(sink, samples=3)
    v0 = ragged_groups(2, 2, seed=3)
    v1 = [replace(g, policy_version=1) for g in ragged_groups(2, 2, seed=4)]
    t.log_step(1, {}, v0)
    t.log_step(2, {}, v0)  # version 0 again: nothing new
    t.log_step(3, {}, [v0[0], *v1])  # the newest version of the step: 1
    t.log_step(4, {}, v0)  # an older version later: not logged
    tables = [c for c in sink.calls if c[0] == "samples"]
    assert [(version, len(rows)) for _, version, rows in tables] == [(0, 3), (1, 3)]
    row = tables[1][2][0]
    assert row["policy_version"] == 1 and row["group_id"] == v1[0].group_id
    assert row["prompt"] == CharTokenizer().decode(v1[0].prompt_ids.tolist())
    assert row["completion"] == CharTokenizer().decode(v1[0].trajectories[0].response_ids.tolist())
    assert row["reward"] == v1[0].trajectories[0].reward
    assert sample_rows(v0, 5, 4, CharTokenizer()) == []


def test_the_config_goes_out_with_its_source_and_the_redis_password_masked():
    sink = Recording()
    t, _ = tracker(sink)
    cfg = LearnerConfig(
        model_path="/m", redis_url="redis://:hunter2@redis:6379/0", tracking={"samples_per_version": 0}
    )
    t.log_config(cfg, "resume", 3, 12)
    ((_, source, version, step, shown),) = sink.calls
    assert (source, version, step) == ("resume", 3, 12)
    assert "hunter2" not in str(shown) and shown["model_path"] == "/m"
    assert t.samples_per_version == 0  # the running config's setting


def test_scalars_keep_finite_numbers_only():
    metrics = {"a": 1, "b": 2.5, "nan": math.nan, "inf": -math.inf, "flag": True, "ids": ["x"], "none": None}
    assert scalars(metrics) == {"a": 1.0, "b": 2.5}
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}) == {"a.b": 1, "a.c.d": [1, 2], "e": None}
    assert markdown_table([{"x": "a|b\nc"}], ("x",)).splitlines()[-1] == "| a\\|b\\nc |"


@pytest.mark.parametrize(
    ("tracking", "field"),
    [
        ({"tensorboard_dir": "/tmp/tb"}, "body.tracking.tensorboard_dir"),
        ({"wandb": {"project": "p"}}, "body.tracking.wandb"),
        ({"mlflow": {"tracking_uri": "sqlite:///m.db"}}, "body.tracking.mlflow"),
    ],
)
def test_a_tracker_whose_package_is_missing_is_a_field_error(monkeypatch, tracking, field):
    real = importlib.util.find_spec
    missing = {"tensorboard", "wandb", "mlflow"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    with pytest.raises(InvalidConfig) as info:
        validate_body({"model_path": "/m", "tracking": tracking})
    (error,) = info.value.detail
    assert error["field"] == field
    assert "pip install 'offpolicy[" in error["message"]


def test_wandb_goes_online_by_itself_when_a_key_is_present():
    pytest.importorskip("wandb")
    from offpolicy.learner.config.tracking import WandbConfig

    auto = WandbConfig(project="p")
    assert auto.mode == "auto" and auto.resolved_mode({}) == "offline"
    assert auto.resolved_mode({"WANDB_API_KEY": "k"}) == "online"
    assert WandbConfig(project="p", mode="offline").resolved_mode({"WANDB_API_KEY": "k"}) == "offline"
    assert WandbConfig(project="p", mode="online").resolved_mode({}) == "online"
