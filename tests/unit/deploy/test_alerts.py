"""Alert rules' behaviour: each rule, fed synthetic series in `promtool test rules`, fires where it should
(its labels and annotations as written) and nowhere else."""

from __future__ import annotations

import re
import subprocess

import yaml

from deploy.checks import alert_rules
from tests.unit.deploy.test_dashboards import promtool


def lag_alert_case(lag: str, max_staleness: str) -> dict:
    """A promtool test: one actor at `lag` versions, the learner's gauge at `max_staleness`, 10 minutes."""
    return {
        "interval": "1m",
        "input_series": [
            {"series": 'offpolicy_actor_policy_lag_versions{instance="actor-0:8001",job="actor"}',
             "values": " ".join([lag] * 11)},
            {"series": 'offpolicy_learner_max_staleness_steps{instance="learner:8000",job="learner"}',
             "values": " ".join([max_staleness] * 11)},
        ],
        "alert_rule_test": [{"eval_time": "10m", "alertname": "OffpolicyActorVersionLag", "exp_alerts": []}],
    }  # fmt: skip


def test_version_lag_alert_compares_with_the_learners_max_staleness(tmp_path):
    """Fires for an actor more than the running max_staleness behind (5 > 4), not at it (4), not when
    the gauge is +Inf (unbounded), and follows a changed max_staleness (5 > 2) with no edit of the rule."""
    (lag,) = [r for r in alert_rules() if r["alert"] == "OffpolicyActorVersionLag"]
    assert "offpolicy_learner_max_staleness_steps" in lag["expr"]
    assert not re.search(r">\s*\d", lag["expr"]), "no hard-coded threshold"
    firing = {
        "exp_labels": {"severity": "warning", "instance": "actor-0:8001"},
        "exp_annotations": {
            "summary": "Actor actor-0:8001 is 5 versions behind the learner",
            "description": lag["annotations"]["description"],
        },
    }
    cases = [lag_alert_case("5", "4"), lag_alert_case("4", "4"), lag_alert_case("5", "+Inf"),
             lag_alert_case("5", "2")]  # fmt: skip
    cases[0]["alert_rule_test"][0]["exp_alerts"] = [firing]
    cases[3]["alert_rule_test"][0]["exp_alerts"] = [firing]
    from deploy.checks import ALERTS_FILE

    path = tmp_path / "lag_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ALERTS_FILE)], "tests": cases}))
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _promtool_test(tmp_path, name: str, cases: list[dict]) -> None:
    from deploy.checks import ALERTS_FILE

    path = tmp_path / f"{name}_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ALERTS_FILE)], "tests": cases}))
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _learner_case(alert: str, series: dict[str, str], fires: bool, summary: str = "") -> dict:
    """A promtool test of a learner alert over 15 one-minute samples of `series` (name -> values)."""
    labels = '{instance="learner:8000",job="learner",run_id="r1"}'
    firing = {
        "exp_labels": {"severity": "critical", "run_id": "r1"},
        "exp_annotations": {
            "summary": summary,
            "description": next(r for r in alert_rules() if r["alert"] == alert)["annotations"][
                "description"
            ],
        },
    }
    return {
        "interval": "1m",
        "input_series": [{"series": name + labels, "values": values} for name, values in series.items()],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": alert, "exp_alerts": [firing] if fires else []}
        ],
    }


def test_checkpoint_old_alert_counts_checkpoint_intervals(tmp_path):
    """Fires past 3 checkpoint intervals without a durable checkpoint (31 > 3 x 10), not at 30, not with
    on-demand checkpoints only (checkpoint_every 0); the interval is the learner's gauge."""

    def case(undurable: str, every: str, fires: bool) -> dict:
        series = {"offpolicy_learner_undurable_steps": f"{undurable}x15",
                  "offpolicy_learner_checkpoint_every_steps": f"{every}x15"}  # fmt: skip
        summary = f"No durable checkpoint for {undurable} learner steps (over 3 checkpoint intervals)"
        return _learner_case("OffpolicyCheckpointOld", series, fires, summary)

    _promtool_test(tmp_path, "checkpoint_old", [case("31", "10", True), case("30", "10", False),
                                                case("100", "0", False)])  # fmt: skip


def test_publishing_failing_alert_fires_only_while_no_version_lands(tmp_path):
    """Fires while weights writes fail and nothing is published; not while publishes still succeed (a
    failure now and then, retried), nor when only checkpoints fail."""

    def case(failures: str, publishes: str, kind: str, fires: bool) -> dict:
        series = {f'offpolicy_learner_write_failures_total{{kind="{kind}",reason="ENOSPC"}}': failures,
                  "offpolicy_learner_publishes_total": publishes}  # fmt: skip
        summary = "Publishing weights is failing: no version published in 10 minutes"
        return _learner_case("OffpolicyPublishingFailing", series, fires, summary)

    cases = [case("0+3x15", "5x15", "weights", True), case("0+3x15", "5+1x15", "weights", False),
             case("0+3x15", "5x15", "checkpoint", False)]  # fmt: skip
    for c in cases:  # the labelled counter series: the run's labels go inside its braces
        for s in c["input_series"]:
            s["series"] = s["series"].replace('"}{', '",')
    _promtool_test(tmp_path, "publishing_failing", cases)


# --- per run, and the actors' and the buffer's alerts


def lag_case(series: dict[str, str], firing_instances: list[str]) -> dict:
    """A promtool test of OffpolicyActorVersionLag over 10 minutes; `series`: selector -> constant value."""
    (lag,) = [r for r in alert_rules() if r["alert"] == "OffpolicyActorVersionLag"]
    expected = [
        {
            "exp_labels": {"severity": "warning", "instance": inst, "run_id": "a"},
            "exp_annotations": {
                "summary": f"Actor {inst} is 5 versions behind the learner",
                "description": lag["annotations"]["description"],
            },
        }
        for inst in firing_instances
    ]
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": " ".join([v] * 11)} for s, v in series.items()],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "OffpolicyActorVersionLag", "exp_alerts": expected}
        ],
    }


def test_version_lag_alert_compares_each_run_with_its_own_learner(tmp_path):
    """Run a's actor (5 behind) against run a's max_staleness (4): fires although run b's learner allows 8;
    run b's actor (5 behind, allowed 8) does not fire."""
    from deploy.checks import ALERTS_FILE

    series = {
        'offpolicy_actor_policy_lag_versions{instance="a-0:8001",job="actor",run_id="a"}': "5",
        'offpolicy_actor_policy_lag_versions{instance="b-0:8001",job="actor",run_id="b"}': "5",
        'offpolicy_learner_max_staleness_steps{instance="la:8000",job="learner",run_id="a"}': "4",
        'offpolicy_learner_max_staleness_steps{instance="lb:8000",job="learner",run_id="b"}': "8",
    }
    path = tmp_path / "lag_runs_test.yml"
    path.write_text(
        yaml.safe_dump({"rule_files": [str(ALERTS_FILE)], "tests": [lag_case(series, ["a-0:8001"])]})
    )
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_buffer_full_alert_fires_on_sustained_back_pressure_only(tmp_path):
    """Refusals every minute for 20 minutes fire (per run and reason); a counter that stopped does not."""
    from deploy.checks import ALERTS_FILE

    (rule,) = [r for r in alert_rules() if r["alert"] == "OffpolicyBufferFull"]
    rising = 'offpolicy_buffer_full_total{instance="a-0:8001",job="actor",run_id="a",reason="max_bytes"}'
    stopped = 'offpolicy_buffer_full_total{instance="b-0:8001",job="actor",run_id="b",reason="max_bytes"}'
    case = {
        "interval": "1m",
        "input_series": [
            {"series": rising, "values": "0+3x30"},
            {"series": stopped, "values": "0+3x5 15x25"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "25m",
                "alertname": "OffpolicyBufferFull",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "run_id": "a", "reason": "max_bytes"},
                        "exp_annotations": {
                            "summary": "Producers held back by a full buffer (max_bytes) for 15 minutes",
                            "description": rule["annotations"]["description"],
                        },
                    }
                ],
            }
        ],
    }
    path = tmp_path / "buffer_full_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ALERTS_FILE)], "tests": [case]}))
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_reward_failing_and_actor_down_alerts(tmp_path):
    """OffpolicyRewardFailing follows the actor's own alarm gauge (5 minutes held; a cleared alarm does not
    fire); OffpolicyActorDown fires for the actor that stopped answering its scrape (2 minutes)."""
    from deploy.checks import ALERTS_FILE

    rules = {r["alert"]: r for r in alert_rules()}
    reward, down = rules["OffpolicyRewardFailing"], rules["OffpolicyActorDown"]
    alarm = 'offpolicy_actor_reward_failure_alarm{instance="%s",job="actor",run_id="a"}'
    up = 'up{instance="%s",job="actor",run_id="a"}'
    case = {
        "interval": "1m",
        "input_series": [
            {"series": alarm % "a-0:8001", "values": "0 0 1x10"},
            {"series": alarm % "a-1:8001", "values": "0 1 1 0x9"},
            {"series": up % "a-0:8001", "values": "1x12"},
            {"series": up % "a-1:8001", "values": "1x5 0x6"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "10m",
                "alertname": "OffpolicyRewardFailing",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "critical", "instance": "a-0:8001", "run_id": "a"},
                        "exp_annotations": {
                            "summary": "Actor a-0:8001: most groups fail their reward",
                            "description": reward["annotations"]["description"],
                        },
                    }
                ],
            },
            {
                "eval_time": "10m",
                "alertname": "OffpolicyActorDown",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "critical", "instance": "a-1:8001", "job": "actor", "run_id": "a"
                        },
                        "exp_annotations": {
                            "summary": "Prometheus cannot scrape actor a-1:8001",
                            "description": down["annotations"]["description"],
                        },
                    }
                ],
            },
        ],
    }  # fmt: skip
    path = tmp_path / "actor_alerts_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ALERTS_FILE)], "tests": [case]}))
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_run_failed_alert_names_the_dead_run_of_a_pool(tmp_path):
    """OffpolicyActorRunFailed fires at once for the run whose loop died (its gauge 1), not for the pool's
    other run, and stops once the run is removed (its series gone)."""
    rule = {r["alert"]: r for r in alert_rules()}["OffpolicyActorRunFailed"]
    failed = 'offpolicy_actor_run_failed{instance="pool-0:8001",job="actor",run_id="%s"}'
    firing = {
        "exp_labels": {"severity": "critical", "instance": "pool-0:8001", "run_id": "b"},
        "exp_annotations": {
            "summary": "Run b on actor pool-0:8001 stopped with an error",
            "description": rule["annotations"]["description"],
        },
    }
    case = {
        "interval": "1m",
        "input_series": [
            {"series": failed % "a", "values": "0x10"},
            {"series": failed % "b", "values": "0 0 1x3 stale"},  # failed at 2m, removed at 6m
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "OffpolicyActorRunFailed", "exp_alerts": []},
            {"eval_time": "3m", "alertname": "OffpolicyActorRunFailed", "exp_alerts": [firing]},
            {"eval_time": "10m", "alertname": "OffpolicyActorRunFailed", "exp_alerts": []},
        ],
    }
    _promtool_test(tmp_path, "run_failed", [case])


def test_transfer_stuck_alert_fires_while_a_teardown_was_stuck_in_the_last_ten_minutes(tmp_path):
    rule = {r["alert"]: r for r in alert_rules()}["OffpolicyTransferStuck"]
    stuck = 'offpolicy_learner_transfer_stuck_total{instance="learner:8000",job="learner",run_id="r"}'
    case = {
        "interval": "1m",
        "input_series": [{"series": stuck, "values": "0 0 0 1x30"}],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "OffpolicyTransferStuck", "exp_alerts": []},
            {
                "eval_time": "5m",
                "alertname": "OffpolicyTransferStuck",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "run_id": "r"},
                        "exp_annotations": {
                            "summary": "A weight-transfer group of the learner is stuck",
                            "description": rule["annotations"]["description"],
                        },
                    }
                ],
            },
            {"eval_time": "30m", "alertname": "OffpolicyTransferStuck", "exp_alerts": []},
        ],
    }
    _promtool_test(tmp_path, "transfer_stuck", [case])
