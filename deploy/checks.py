"""Checks of the deploy artefacts that the tests share: compose loading, PromQL names, dashboard walking."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
ALERTS_FILE = ROOT / "deploy" / "prometheus" / "alerts.yml"

# --- docker compose: YAML tags, interpolation, merging


class Reset:
    """A value tagged `!reset` in a compose override: the merged file drops the key."""


class Override:
    """A value tagged `!override` in a compose override: it replaces the base value whole."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    """PyYAML's safe loader plus compose's `!reset` and `!override` tags."""


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: Override(
        loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)
    ),
)


def load_compose(path: Path) -> dict[str, Any]:
    """One compose file, with `!reset` / `!override` kept as markers for `merge_compose`."""
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def strip_tags(value: Any) -> Any:
    """The file as a compose tool validates it on its own: `!reset x` / `!override x` read as `x`."""
    if isinstance(value, Mapping):
        return {k: strip_tags(v) for k, v in value.items() if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [strip_tags(v) for v in value]
    return value.value if isinstance(value, Override) else value


# Sequences that compose merges by a key (the container path of a volume, the name of a network),
# the others are unioned; `command`-like sequences are replaced (compose-spec's merge rules). GPU
# reservations (`deploy.resources.reservations.devices`) are appended: an override or an `extends` that
# names other GPUs adds them to the base's unless it says `!override`.
_REPLACED = {"command", "entrypoint", "test"}
_BRACED_VAR = re.compile(r"\$\{[^}]*\}")


def _volume_target(entry: Any) -> str:
    """A volume's container path; a `${VAR:-default}` source (its `:` included) is skipped whole, as compose
    merges after interpolating."""
    return entry["target"] if isinstance(entry, Mapping) else _BRACED_VAR.sub("", str(entry)).split(":")[1]


def merge_compose(base: Any, over: Any, key: str = "") -> Any:
    """Merge an override file into a base file following compose-spec's merge rules (the subset used)."""
    if isinstance(over, Override):
        return strip_tags(over.value)
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            else:
                out[k] = merge_compose(out[k], v, k) if k in out else strip_tags(v)
        return out
    if isinstance(base, list) and isinstance(over, list) and key not in _REPLACED:
        if key == "volumes":
            merged = {_volume_target(e): e for e in base}
            merged.update({_volume_target(e): e for e in over})
            return list(merged.values())
        return base + [e for e in over if e not in base]
    return strip_tags(over)


def resolve_extends(doc: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Apply `extends: {file, service}` within one compose file, as compose does before it merges files:
    the referenced service (itself resolved) merged with the local definition, tags honoured."""
    services = dict(doc.get("services", {}))
    for name, service in services.items():
        extends = service.get("extends") if isinstance(service, Mapping) else None
        if extends is None:
            continue
        if isinstance(extends, str) or "file" not in extends:
            raise ValueError(f"{name}: only `extends: {{file, service}}` is modelled")
        source = folder / extends["file"]
        base = resolve_extends(load_compose(source), source.parent)["services"][extends["service"]]
        local = {k: v for k, v in service.items() if k != "extends"}
        services[name] = merge_compose(base, local)
    return {**doc, "services": services}


def load_compose_resolved(path: Path) -> dict[str, Any]:
    """One compose file with its `extends` applied (tags of the file itself kept for `merge_compose`)."""
    return resolve_extends(load_compose(path), path.parent)


def gpu_ids(service: Mapping[str, Any]) -> list[str]:
    """The host GPU ids a service reserves: every `device_ids` entry split at commas (Docker joins them
    with commas into NVIDIA_VISIBLE_DEVICES); `count: n` reads as `count:n` (it means GPUs 0..n-1)."""
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    out: list[str] = []
    for device in devices:
        if "count" in device:
            out.append(f"count:{device['count']}")
        for entry in device.get("device_ids", []):
            out += [part.strip() for part in str(entry).split(",")]
    return out


def nproc_per_node(args: list[str]) -> int | None:
    """The value of `--nproc-per-node N` / `--nproc-per-node=N` in a command line, None when absent."""
    for i, arg in enumerate(args):
        if arg == "--nproc-per-node" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--nproc-per-node="):
            return int(arg.partition("=")[2])
    return None


_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]+)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?$", re.DOTALL)


class MissingVariable(ValueError):
    """A `${VAR:?message}` whose variable is unset or empty."""


def _substitute(text: str, env: Mapping[str, str], used: set[str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            used.add(match["named"])
            return env.get(match["named"], "")
        braced = _BRACED.match(match["braced"])
        if braced is None:
            raise ValueError(f"invalid interpolation ${{{match['braced']}}}")
        name, op, arg = braced["name"], braced["op"], braced["arg"]
        used.add(name)
        value = env.get(name)
        empty = value is None or (op is not None and op.startswith(":") and value == "")
        if op in (":?", "?") and empty:
            raise MissingVariable(f"{name}: {arg}")
        if op in (":-", "-") and empty:
            return arg
        if op in (":+", "+"):
            return "" if empty else arg
        return value or ""

    return _VAR.sub(one, text)


def interpolate(value: Any, env: Mapping[str, str], used: set[str] | None = None) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR:?error}`, `$$` over every string of `value`."""
    used = set() if used is None else used
    if isinstance(value, Mapping):
        return {k: interpolate(v, env, used) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, used) for v in value]
    return _substitute(value, env, used) if isinstance(value, str) else value


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=value` lines of an env file (comments and blank lines skipped)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


# --- PromQL: the metric names an expression reads

_PROMQL_WORDS = set(
    # functions, aggregations and keywords that look like names
    """abs absent absent_over_time avg avg_over_time bool by ceil changes clamp clamp_max clamp_min count
    count_over_time count_values delta deriv exp floor group group_left group_right histogram_quantile
    idelta ignoring increase irate label_replace last_over_time ln log2 log10 max max_over_time min
    min_over_time offset on or and unless predict_linear quantile quantile_over_time rate resets round
    scalar sgn sort sort_desc sqrt stddev stddev_over_time stdvar sum sum_over_time time timestamp topk
    bottomk vector without inf nan present_over_time""".split()  # noqa: SIM905
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABELS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (labels, strings, functions and grafana `$vars` excluded)."""
    text = _STRING.sub('""', expr)
    text = _LABELS.sub("", text)
    text = _RANGE.sub("", text)
    text = _GROUPING.sub("", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    return {name for name in _IDENT.findall(text) if name not in _PROMQL_WORDS}


def base_metric_name(sample_name: str) -> str:
    """`x_bucket` / `x_count` / `x_sum` → `x`; a counter's series keeps its `_total`."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


# --- Grafana dashboards and alert rules


def load_dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard JSON of deploy/grafana/dashboards, by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [
        (panel.get("title", ""), target["expr"])
        for panel in iter_panels(dashboard)
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def annotation_exprs(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(annotation name, PromQL) for every Prometheus annotation query of a dashboard."""
    return [(a["name"], a["expr"]) for a in dashboard.get("annotations", {}).get("list", []) if "expr" in a]


def alert_rules() -> list[dict[str, Any]]:
    """Every rule (alerting and recording) of deploy/prometheus/alerts.yml."""
    doc = yaml.safe_load(ALERTS_FILE.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def all_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard panel target and annotation and every alert rule."""
    out = [
        (f"{name}: {title}", expr)
        for name, dashboard in load_dashboards().items()
        for title, expr in dashboard_exprs(dashboard) + annotation_exprs(dashboard)
    ]
    out += [(f"alerts.yml: {rule.get('alert', rule.get('record'))}", rule["expr"]) for rule in alert_rules()]
    return out


# --- the metric names the components declare

SYNTHETIC_METRICS = {"up"}
"""Series that Prometheus itself writes for every target; no component declares them."""


def declared_metric_names() -> set[str]:
    """Every metric name that buffer/, learner/ and actors/metrics.py declare, and the learner's transfer
    metrics (learner/transport/publisher.py); counters with `_total`."""
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.buffer.metrics import BufferMetrics
    from offpolicy.learner.metrics import LearnerMetrics
    from offpolicy.learner.transport.publisher import TransferMetrics

    registry = CollectorRegistry()
    for metrics_class in (BufferMetrics, LearnerMetrics, ActorMetrics, TransferMetrics):
        metrics_class(registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def grafana_to_promql(expr: str, rate_window: str = "1m") -> str:
    """A dashboard expression as Prometheus can run it: `$__rate_interval` and `$var` (All = `.*`) filled."""
    expr = expr.replace("$__rate_interval", rate_window).replace("${__rate_interval}", rate_window)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


# --- the environment a deployment hands to a service

SERVICE_CONFIGS = {"learner": ROOT / "configs" / "learner.yaml", "actor": ROOT / "configs" / "actor.yaml"}
"""The config file each service reads (`--config`); the deployments mount these files."""


def kustomize(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize k8s/overlays/<overlay>` (kustomize v5, built into kubectl), parsed."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise FileNotFoundError("kubectl (with its built-in kustomize) is needed: apt-get install kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"kustomize {overlay}: {out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


_K8S_REF = re.compile(r"\$\((\w+)\)")


def pod_environment(
    container: Mapping[str, Any],
    pod_name: str,
    pod_index: int,
    config_maps: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, str]:
    """A container's `env` as the kubelet resolves it for one pod: the `fieldRef`s this project uses,
    `configMapKeyRef`s from `config_maps` (ConfigMap name -> data), each `secretKeyRef` as
    `secret-<key>`, and `$(VAR)` references to earlier variables."""
    fields = {
        "metadata.name": pod_name,
        "metadata.labels['apps.kubernetes.io/pod-index']": str(pod_index),  # a StatefulSet's ordinal
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(pod_index),  # Indexed Job
    }
    env: dict[str, str] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            value = fields[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = (config_maps or {})[ref["name"]][ref["key"]]
        elif "secretKeyRef" in source:
            value = f"secret-{source['secretKeyRef']['key']}"
        else:
            value = _K8S_REF.sub(lambda m: env.get(m[1], m[0]), str(var.get("value", "")))
        env[var["name"]] = value
    return env


def config_maps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The ConfigMaps of a kustomize build: name (with its hash suffix) -> data."""
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
