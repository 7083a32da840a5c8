"""Grafana dashboards and alert rules: valid structure, rendered files current, only declared metrics; what
each alert rule fires on is test_alerts.py."""

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
