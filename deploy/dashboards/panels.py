"""Dashboards as data: the panel / variable / dashboard model, PromQL helpers, and the Grafana JSON builder.

A `DashboardSpec` is rows of `Panel`s (title, PromQL targets, unit); `build_dashboard` lays them out 24
wide and writes Grafana JSON (schemaVersion 39). Rates use Grafana's `$__rate_interval`; every panel reads
the `datasource` variable, so the dashboards work with any Prometheus data source.

Runs: every sample the services export carries `run_id` (services/common/metrics.py). Every dashboard has
a `run_id` variable (multi-select, `All` by default) and `build_dashboard` adds `run_id=~"$run_id"` to
every metric selector of every panel and annotation (`for_runs`), so the specs name metrics plainly. Every
dashboard also shows the `CONFIG_CHANGES` annotation: a marker where the learner applied a config change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}
LC = "offpolicy_learner_rollout_corr_"  # every rollout_corr/<key> of the spec is a learner gauge
RUN_VAR = "run_id"
RUN_METRIC = "offpolicy_buffer_size_groups"
"""The metric whose `run_id` values the variable lists: the learner and every actor export it."""
UNLABELLED = {"up"}
"""Series Prometheus writes itself (no `run_id`): their selectors are left as written."""


@dataclass(frozen=True)
class Panel:
    """One panel: PromQL targets as (expression, legend) pairs."""

    title: str
    targets: tuple[tuple[str, str], ...]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 8
    text_mode: str = "auto"
    """Stat panels: `auto` shows the value; `name` shows the series' legend (a label, e.g. a preset)."""


@dataclass(frozen=True)
class Annotation:
    """A Prometheus annotation: a marker wherever `expr` returns a series; title and text are Grafana
    templates over its labels (`{{label}}`)."""

    name: str
    expr: str
    title: str
    text: str
    color: str = "orange"


@dataclass(frozen=True)
class Variable:
    """A query variable over one label of one metric (multi-select, `All` = `.*`)."""

    name: str
    label: str
    metric: str


@dataclass(frozen=True)
class DashboardSpec:
    """A dashboard: rows of panels under a title."""

    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]
    variables: tuple[Variable, ...] = field(default=())


def q(expr: str, legend: str = "") -> tuple[str, str]:
    return (expr, legend)


def p90(hist: str, by: str = "", sel: str = "") -> str:
    """90th percentile of a histogram over the rate window, optionally split by labels."""
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile(0.9, sum by ({group}) (rate({hist}_bucket{sel}[{RATE}])))"


def mean_of(hist: str, by: str = "", sel: str = "") -> str:
    """Mean observation of a histogram over the rate window."""
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({hist}_sum{sel}[{RATE}])) / {agg} (rate({hist}_count{sel}[{RATE}]))"


# --- the run_id matcher on every selector

_WORDS = set(
    # PromQL functions, aggregations and keywords: names that are not metrics
    """abs absent absent_over_time and avg avg_over_time bool bottomk by ceil changes clamp clamp_max
    clamp_min count count_over_time count_values delta deriv exp floor group group_left group_right
    histogram_quantile idelta ignoring increase inf irate label_replace last_over_time ln log10 log2 max
    max_over_time min min_over_time nan offset on or predict_linear present_over_time quantile
    quantile_over_time rate resets round scalar sgn sort sort_desc sqrt stddev stddev_over_time stdvar
    sum sum_over_time time timestamp topk unless vector without""".split()  # noqa: SIM905
)
_TOKEN = re.compile(
    r""""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'"""  # a string
    r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"  # grouping labels
    r"|\{[^}]*\}|\[[^\]]*\]"  # label matchers, a range or subquery
    r"|\d[\w.]*|\$\{?\w+\}?"  # a number or duration, a Grafana variable
    r"|(?P<name>[A-Za-z_:][\w:]*)"
)


def for_runs(expr: str, var: str = RUN_VAR) -> str:
    """`expr` with `run_id=~"$<var>"` added to every metric selector (first in an existing `{...}`);
    functions, keywords, grouping labels, strings and `UNLABELLED` series stay as they are."""
    matcher = f'{RUN_VAR}=~"${var}"'
    out, pos = [], 0
    for m in _TOKEN.finditer(expr):
        if m.start() < pos:  # inside matchers already copied
            continue
        out.append(expr[pos : m.start()])
        pos, token = m.end(), m.group()
        rest = expr[pos:]
        if m.group("name") and token not in _WORDS | UNLABELLED and not rest.lstrip().startswith("("):
            if rest.startswith("{"):
                inner = rest[1 : rest.index("}")].strip()
                token += "{" + matcher + (", " + inner if inner else "") + "}"
                pos += rest.index("}") + 1
            else:
                token += "{" + matcher + "}"
        out.append(token)
    out.append(expr[pos:])
    return "".join(out)


# --- the JSON builder


def _panel_json(panel: Panel, pid: int, x: int, y: int, height: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DS,
                "expr": for_runs(expr),
                "legendFormat": legend or "__auto",
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }
    if panel.kind == "timeseries":
        body["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        }
    else:
        body["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": panel.text_mode,
        }
    return body


def _variables(spec: DashboardSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {"text": "Prometheus", "value": "prometheus"},
            "hide": 0,
        }
    ]
    for var in (Variable(RUN_VAR, RUN_VAR, RUN_METRIC), *spec.variables):
        metric = var.metric if var.name == RUN_VAR else for_runs(var.metric)  # the others: of the runs picked
        query = f"label_values({metric}, {var.label})"
        out.append(
            {
                "name": var.name,
                "label": var.label,
                "type": "query",
                "datasource": DS,
                "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "definition": query,
                "refresh": 2,
                "multi": True,
                "includeAll": True,
                "allValue": ".*",
                "current": {"text": "All", "value": "$__all"},
                "sort": 1,
                "hide": 0,
            }
        )
    return out


CONFIG_CHANGES = Annotation(
    "Config changes",
    "max by (run_id, config_version, preset) (offpolicy_learner_config_info)"
    f" and on (run_id) (changes(offpolicy_learner_config_version[{RATE}]) > 0)",
    title="config_version {{config_version}}",
    text="The learner applied config_version {{config_version}} (run {{run_id}}, rollout-correction "
    "preset {{preset}}); GET /v1/config/history shows what changed.",
)
"""A marker on every dashboard where a config change took effect: the learner's config version moved
(PATCH, PUT, a preset switch, a resumed config). Labels: the new version, its preset, the run."""


def _annotations() -> list[dict[str, Any]]:
    builtin = {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }
    return [
        builtin,
        *(
            {
                "name": a.name,
                "datasource": DS,
                "enable": True,
                "hide": False,
                "iconColor": a.color,
                "expr": for_runs(a.expr),
                "step": "15s",
                "titleFormat": a.title,
                "textFormat": a.text,
                "tagKeys": "run_id,preset",
                "useValueForTime": False,
            }
            for a in (CONFIG_CHANGES,)
        ),
    ]


def build_dashboard(spec: DashboardSpec) -> dict[str, Any]:
    """The Grafana dashboard JSON (schemaVersion 39) of one spec: a row panel then its panels, 24 wide."""
    panels: list[dict[str, Any]] = []
    y, pid = 0, 1
    for row_title, row_panels in spec.rows:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        height = 4 if all(p.kind == "stat" for p in row_panels) else 8
        for panel in row_panels:
            if x + panel.width > 24:
                x, y = 0, y + height
            panels.append(_panel_json(panel, pid, x, y, height))
            pid, x = pid + 1, x + panel.width
        y += height
    return {
        "uid": spec.uid,
        "title": spec.title,
        "description": spec.description,
        "tags": ["offpolicy"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "links": [
            {
                "type": "dashboards",
                "tags": ["offpolicy"],
                "asDropdown": True,
                "title": "offpolicy",
                "icon": "external link",
            }
        ],
        "templating": {"list": _variables(spec)},
        "annotations": {"list": _annotations()},
        "panels": panels,
    }
