"""Dashboards as data: the panel / variable / dashboard model, PromQL helpers, and the Grafana JSON builder.

A `DashboardSpec` is rows of `Panel`s (title, PromQL targets, unit); `build_dashboard` lays them out 24
wide and writes Grafana JSON (schemaVersion 39). Rates use Grafana's `$__rate_interval`; every panel reads
the `datasource` variable, so the dashboards work with any Prometheus data source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}
LC = "offpolicy_learner_rollout_corr_"  # every rollout_corr/<key> of the spec is a learner gauge


@dataclass(frozen=True)
class Panel:
    """One panel: PromQL targets as (expression, legend) pairs."""

    title: str
    targets: tuple[tuple[str, str], ...]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 8


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
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend or "__auto"}
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }
    if panel.kind == "timeseries":
        body["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        }
    else:
        body["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
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
    for var in spec.variables:
        query = f"label_values({var.metric}, {var.label})"
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
        "annotations": {"list": []},
        "panels": panels,
    }
