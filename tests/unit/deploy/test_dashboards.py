"""Grafana dashboards and alert rules: valid structure, rendered files current, only declared metrics."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from deploy import render
from deploy.checks import (
    SYNTHETIC_METRICS,
    alert_rules,
    all_exprs,
    annotation_exprs,
    base_metric_name,
    dashboard_exprs,
    declared_metric_names,
    grafana_to_promql,
    iter_panels,
    load_dashboards,
    promql_metric_names,
)

BUILTIN_VARS = {"__rate_interval", "__interval", "__range"}
DS = {"type": "prometheus", "uid": "${datasource}"}


def test_rendered_files_are_current():
    assert render.stale_files() == [], "run `python deploy/render.py`"


def test_the_five_dashboards_exist_with_unique_uids():
    dashboards = load_dashboards()
    assert {d["uid"] for d in dashboards.values()} == {
        "offpolicy-overview", "offpolicy-correction", "offpolicy-buffer", "offpolicy-actors",
        "offpolicy-learner",
    }  # fmt: skip
    for name, dashboard in dashboards.items():
        assert name == f"{dashboard['uid']}.json"
        assert len(dashboard["uid"]) <= 40 and dashboard["title"] and dashboard["schemaVersion"] >= 36


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_dashboard_structure(name):
    dashboard = load_dashboards()[name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids, cells = set(), set()
    for panel in iter_panels(dashboard):
        assert panel["id"] not in ids, f"duplicate panel id {panel['id']}"
        ids.add(panel["id"])
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DS, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids)
        for target in panel["targets"]:
            assert target["datasource"] == DS and target["expr"].strip()


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_no_dangling_variables(name):
    dashboard = load_dashboards()[name]
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    text = "\n".join(
        [t["expr"] for p in iter_panels(dashboard) for t in p.get("targets", [])]
        + [p["datasource"]["uid"] for p in iter_panels(dashboard) if "datasource" in p]
    )
    used = set(re.findall(r"\$\{?(\w+)\}?", text)) - BUILTIN_VARS
    assert used <= defined, f"undefined variables: {used - defined}"
    assert defined <= used, f"variables no panel uses: {defined - used}"
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == DS
            (metric,) = re.findall(r"label_values\((\w+)[{,]", var["definition"])
            assert metric in declared_metric_names()


def test_every_metric_used_is_declared_by_a_component():
    declared = declared_metric_names() | SYNTHETIC_METRICS
    missing = {}
    for where, expr in all_exprs():
        names = {base_metric_name(n) for n in promql_metric_names(expr)}
        unknown = {n for n in names if n not in declared and f"{n}_total" not in declared}
        if unknown:
            missing[where] = sorted(unknown)
    assert missing == {}


def test_metric_name_extraction():
    expr = (
        'histogram_quantile(0.9, sum by (le, phase) (rate(a_b_bucket{phase="x",i=~"$i"}[$__rate_interval])))'
        " / on(job) group_left c_total offset 5m and up{job='learner'} == 0"
    )
    assert promql_metric_names(expr) == {"a_b_bucket", "c_total", "up"}
    assert base_metric_name("a_b_bucket") == "a_b"


def test_required_alerts_exist():
    names = {rule["alert"] for rule in alert_rules()}
    assert {
        "OffpolicyEffectiveSampleSizeLow", "OffpolicyChiSquaredSpike", "OffpolicyBufferStarved",
        "OffpolicyBufferSaturated", "OffpolicyActorVersionLag", "OffpolicyWeightReloadFailures",
        "OffpolicyLearnerStalled",
    } <= names  # fmt: skip
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is needed (Debian's prometheus package; `make test` installs it)")
    return path


def test_promtool_checks_the_rules_and_the_compose_config():
    from deploy.checks import ALERTS_FILE, ROOT

    for args in (
        ["check", "rules", str(ALERTS_FILE)],
        ["check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
    ):
        out = subprocess.run([promtool(), *args], capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stdout + out.stderr


def test_every_dashboard_expression_parses(tmp_path):
    """promtool parses each panel's PromQL (Grafana variables filled) as a recording rule."""
    rules = [
        {"record": f"offpolicy:panel_{i}", "expr": grafana_to_promql(expr)}
        for i, (_, expr) in enumerate(all_exprs())
    ]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


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


# --- runs and config changes


def test_for_runs_adds_the_run_matcher_to_every_selector_and_nothing_else():
    from deploy.dashboards.panels import for_runs

    expr = (
        'histogram_quantile(0.9, sum by (le, phase) (rate(a_bucket{phase="x"}[$__rate_interval])))'
        ' / on (job) group_left () b_total offset 5m and up{job="learner"} == 0 and c > 1e-4'
    )
    assert for_runs(expr) == (
        'histogram_quantile(0.9, sum by (le, phase) (rate(a_bucket{run_id=~"$run_id", phase="x"}'
        '[$__rate_interval]))) / on (job) group_left () b_total{run_id=~"$run_id"} offset 5m'
        ' and up{job="learner"} == 0 and c{run_id=~"$run_id"} > 1e-4'
    )


def selected_runs(expr: str) -> dict[str, bool]:
    """Each metric an expression reads (`up` aside) -> whether every selector of it has the run matcher."""
    out = {}
    for name in promql_metric_names(expr) - SYNTHETIC_METRICS:
        uses = re.findall(rf"(?<![\w:]){name}(?![\w:])(\{{[^}}]*\}})?", expr)
        out[name] = all('run_id=~"$run_id"' in braces for braces in uses)
    return out


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_every_query_follows_the_run_variable(name):

    dashboard = load_dashboards()[name]
    (run,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run_id"]
    assert run["includeAll"] and run["multi"] and run["current"]["value"] == "$__all"
    assert run["definition"] == "label_values(offpolicy_buffer_size_groups, run_id)"
    exprs = dashboard_exprs(dashboard) + annotation_exprs(dashboard)
    unscoped = {title: s for title, expr in exprs if not all((s := selected_runs(expr)).values())}
    assert unscoped == {}
    for var in dashboard["templating"]["list"][2:]:  # variables of one dashboard: of the runs picked
        assert 'run_id=~"$run_id"' in var["definition"], var["name"]


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_every_dashboard_marks_config_changes(name):

    dashboard = load_dashboards()[name]
    (changes,) = [a for a in dashboard["annotations"]["list"] if a["name"] == "Config changes"]
    assert changes["enable"] and changes["datasource"] == DS
    assert {"offpolicy_learner_config_version", "offpolicy_learner_config_info"} <= promql_metric_names(
        changes["expr"]
    )
    assert "changes(offpolicy_learner_config_version" in changes["expr"]
    assert "{{config_version}}" in changes["titleFormat"] and "{{preset}}" in changes["textFormat"]
    assert [title for title, _ in annotation_exprs(dashboard)] == ["Config changes"]


@pytest.mark.parametrize("name", ["offpolicy-overview.json", "offpolicy-learner.json"])
def test_running_config_panels(name):
    panels = {p["title"]: p for p in iter_panels(load_dashboards()[name])}
    version, preset = panels["Config version"], panels["Active rollout-correction preset"]
    assert version["type"] == preset["type"] == "stat"
    assert promql_metric_names(version["targets"][0]["expr"]) == {"offpolicy_learner_config_version"}
    assert promql_metric_names(preset["targets"][0]["expr"]) == {"offpolicy_learner_config_info"}
    assert preset["options"]["textMode"] == "name" and preset["targets"][0]["legendFormat"] == "{{preset}}"
    assert "by (preset)" in preset["targets"][0]["expr"]


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
