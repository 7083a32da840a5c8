"""The five Grafana dashboards as data (panel title, PromQL, unit) and the builder of their JSON.

Every metric named here is declared in `buffer/metrics.py`, `learner/metrics.py` or `actors/metrics.py`
(tests/unit/test_deploy_dashboards.py checks it). Rates use Grafana's `$__rate_interval`; every panel
reads the `datasource` variable, so the dashboards work with any Prometheus data source.
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


# --- Overview: throughput, versions, reward, staleness

OVERVIEW = DashboardSpec(
    uid="offpolicy-overview",
    title="offpolicy / Overview",
    description="Throughput, policy versions, reward and staleness of one offpolicy run.",
    rows=(
        (
            "Now",
            (
                Panel("Policy version", (q("max(offpolicy_learner_policy_version)"),), kind="stat", width=4),
                Panel(
                    "Learner steps / min",
                    (q(f"sum(rate(offpolicy_learner_steps_total[{RATE}])) * 60"),),
                    kind="stat",
                    width=4,
                ),
                Panel(
                    "Tokens trained / s",
                    (q("sum(offpolicy_learner_tokens_per_second)"),),
                    kind="stat",
                    width=4,
                ),
                Panel(
                    "Tokens generated / s",
                    (q(f"sum(rate(offpolicy_actor_generated_tokens_total[{RATE}]))"),),
                    kind="stat",
                    width=4,
                ),
                Panel("Actors up", (q('count(up{job="actor"} == 1)'),), kind="stat", width=4),
                Panel("Learner paused", (q("max(offpolicy_learner_paused)"),), kind="stat", width=4),
            ),
        ),
        (
            "Progress",
            (
                Panel(
                    "Throughput",
                    (
                        q("sum(offpolicy_learner_tokens_per_second)", "trained tokens/s"),
                        q(f"sum(rate(offpolicy_actor_generated_tokens_total[{RATE}]))", "generated tokens/s"),
                    ),
                ),
                Panel(
                    "Policy versions",
                    (
                        q("max(offpolicy_learner_policy_version)", "learner"),
                        q("min(offpolicy_actor_policy_version)", "oldest actor"),
                        q("max(offpolicy_actor_policy_version)", "newest actor"),
                    ),
                ),
                Panel(
                    "Reward (mean of the sampled batch)", (q("avg(offpolicy_learner_reward_mean)", "reward"),)
                ),
                Panel(
                    "Staleness of sampled groups",
                    (
                        q("avg(offpolicy_learner_staleness_mean_steps)", "mean"),
                        q(p90("offpolicy_learner_sampled_staleness_steps"), "p90"),
                    ),
                    description="Learner version minus the version that generated each sampled group.",
                ),
                Panel(
                    "Buffer fill",
                    (q("max(offpolicy_buffer_fill_ratio)", "fill"),),
                    unit="percentunit",
                ),
                Panel(
                    "Effective sample size of IS weights",
                    (q(f"avg({LC}rollout_is_eff_sample_size)", "ESS"),),
                    unit="percentunit",
                ),
            ),
        ),
    ),
)

# --- Off-policy correction: IS / ESS / chi2 / KL / RS, KL by staleness bucket

CORRECTION = DashboardSpec(
    uid="offpolicy-correction",
    title="offpolicy / Off-policy correction",
    description="Rollout-correction diagnostics (spec section 6) and the off-policy KL by staleness bucket.",
    rows=(
        (
            "Importance weights",
            (
                Panel(
                    "IS weight mean / min / max",
                    (
                        q(f"avg({LC}rollout_is_mean)", "mean"),
                        q(f"min({LC}rollout_is_min)", "min"),
                        q(f"max({LC}rollout_is_max)", "max"),
                    ),
                ),
                Panel(
                    "Effective sample size",
                    (q(f"avg({LC}rollout_is_eff_sample_size)", "ESS"),),
                    unit="percentunit",
                    description="1 / mean(normalised weight^2): 1 = on-policy, near 0 = few tokens dominate.",
                ),
                Panel(
                    "Weights outside the bounds",
                    (
                        q(f"avg({LC}rollout_is_ratio_fraction_high)", "above upper"),
                        q(f"avg({LC}rollout_is_ratio_fraction_low)", "below lower"),
                    ),
                    unit="percentunit",
                ),
                Panel(
                    "Token IS weight quantiles",
                    (
                        q(
                            "histogram_quantile(0.1, sum by (le) "
                            f"(rate(offpolicy_learner_token_is_weight_bucket[{RATE}])))",
                            "p10",
                        ),
                        q(
                            "histogram_quantile(0.5, sum by (le) "
                            f"(rate(offpolicy_learner_token_is_weight_bucket[{RATE}])))",
                            "p50",
                        ),
                        q(p90("offpolicy_learner_token_is_weight"), "p90"),
                    ),
                ),
            ),
        ),
        (
            "Divergence",
            (
                Panel(
                    "chi-squared divergence",
                    (q(f"avg({LC}chi2_token)", "token"), q(f"avg({LC}chi2_seq)", "sequence")),
                ),
                Panel(
                    "KL(rollout || train)",
                    (q(f"avg({LC}kl)", "k1"), q(f"avg({LC}k3_kl)", "k3")),
                ),
                Panel(
                    "Off-policy KL by staleness bucket",
                    (q("avg by (staleness) (offpolicy_learner_offpolicy_kl)", "staleness {{staleness}}"),),
                    description="k1 KL of the last step's tokens, by how many versions old their group was.",
                ),
                Panel(
                    "Perplexity ratio (train / rollout)",
                    (
                        q(f"avg({LC}ppl_ratio)", "ppl ratio"),
                        q(f"avg({LC}log_ppl_abs_diff)", "|log ppl diff|"),
                    ),
                ),
            ),
        ),
        (
            "Rejection sampling and loss",
            (
                Panel(
                    "RS masked fraction",
                    (
                        q(f"avg({LC}rollout_rs_masked_fraction)", "tokens"),
                        q(f"avg({LC}rollout_rs_seq_masked_fraction)", "sequences"),
                    ),
                    unit="percentunit",
                ),
                Panel(
                    "PPO clip fraction",
                    (
                        q("avg(offpolicy_learner_actor_pg_clipfrac)", "clipped"),
                        q("avg(offpolicy_learner_actor_pg_clipfrac_lower)", "dual-clip lower"),
                    ),
                    unit="percentunit",
                ),
                Panel("PPO KL (policy vs old)", (q("avg(offpolicy_learner_actor_ppo_kl)", "ppo_kl"),)),
            ),
        ),
    ),
)

# --- Buffer: size, insert / sample rates, drops, rate limiting

BUFFER = DashboardSpec(
    uid="offpolicy-buffer",
    title="offpolicy / Buffer",
    description="The Redis replay buffer as its clients see it: size, traffic, drops and rate limiting.",
    rows=(
        (
            "Contents",
            (
                Panel("Groups stored", (q("max(offpolicy_buffer_size_groups)", "groups"),)),
                Panel("Fill ratio", (q("max(offpolicy_buffer_fill_ratio)", "fill"),), unit="percentunit"),
                Panel(
                    "Staleness of sampled groups",
                    (
                        q(mean_of("offpolicy_buffer_sampled_staleness_versions"), "mean"),
                        q(p90("offpolicy_buffer_sampled_staleness_versions"), "p90"),
                    ),
                ),
            ),
        ),
        (
            "Traffic",
            (
                Panel(
                    "Inserts and samples",
                    (
                        q(f"sum(rate(offpolicy_buffer_inserts_total[{RATE}]))", "inserted groups/s"),
                        q(f"sum(rate(offpolicy_buffer_samples_total[{RATE}]))", "sampled groups/s"),
                        q(f"sum(rate(offpolicy_buffer_duplicates_total[{RATE}]))", "duplicate inserts/s"),
                    ),
                    unit="ops",
                ),
                Panel(
                    "Drops and evictions by reason",
                    (
                        q(
                            f"sum by (reason) (rate(offpolicy_buffer_drops_total[{RATE}]))",
                            "drop: {{reason}}",
                        ),
                        q(
                            f"sum by (reason) (rate(offpolicy_buffer_evictions_total[{RATE}]))",
                            "evict: {{reason}}",
                        ),
                    ),
                    unit="ops",
                ),
                Panel(
                    "Rejected groups by field",
                    (q(f"sum by (field) (rate(offpolicy_buffer_rejected_total[{RATE}]))", "{{field}}"),),
                    unit="ops",
                ),
            ),
        ),
        (
            "Latency and rate limiting",
            (
                Panel(
                    "Rate-limited waits by operation",
                    (q(f"sum by (op) (rate(offpolicy_buffer_rate_limited_waits_total[{RATE}]))", "{{op}}"),),
                    unit="ops",
                ),
                Panel(
                    "Insert / sample latency p90",
                    (
                        q(p90("offpolicy_buffer_insert_latency_seconds"), "insert"),
                        q(p90("offpolicy_buffer_sample_latency_seconds"), "sample"),
                    ),
                    unit="s",
                ),
                Panel(
                    "Redis retries",
                    (q(f"sum(rate(offpolicy_buffer_storage_retries_total[{RATE}]))", "retries/s"),),
                    unit="ops",
                ),
            ),
        ),
    ),
)

# --- Actors: tokens/s, version lag, reloads

A = '{instance=~"$instance"}'
ACTORS = DashboardSpec(
    uid="offpolicy-actors",
    title="offpolicy / Actors",
    description="Every actor: generation throughput, loaded policy version, weight reloads, failures.",
    variables=(Variable("instance", "instance", "offpolicy_actor_policy_version"),),
    rows=(
        (
            "Generation",
            (
                Panel(
                    "Tokens generated / s",
                    (
                        q(
                            f"sum by (instance) (rate(offpolicy_actor_generated_tokens_total{A}[{RATE}]))",
                            "{{instance}}",
                        ),
                    ),
                ),
                Panel(
                    "Tokens / s of the last batch",
                    (q(f"max by (instance) (offpolicy_actor_tokens_per_second{A})", "{{instance}}"),),
                ),
                Panel(
                    "Groups pushed / s",
                    (
                        q(
                            f"sum by (instance) (rate(offpolicy_actor_groups_pushed_total{A}[{RATE}]))",
                            "{{instance}}",
                        ),
                        q(f"sum(rate(offpolicy_actor_duplicate_groups_total{A}[{RATE}]))", "duplicates"),
                    ),
                    unit="ops",
                ),
                Panel(
                    "Failures by reason",
                    (q(f"sum by (reason) (rate(offpolicy_actor_failures_total{A}[{RATE}]))", "{{reason}}"),),
                    unit="ops",
                ),
            ),
        ),
        (
            "Weights",
            (
                Panel(
                    "Loaded version lag behind the learner",
                    (q(f"max by (instance) (offpolicy_actor_policy_lag_versions{A})", "{{instance}}"),),
                ),
                Panel(
                    "Reload duration p90",
                    (q(p90("offpolicy_actor_reload_seconds", "instance", A), "{{instance}}"),),
                    unit="s",
                ),
                Panel(
                    "Reloads and reload failures by reason",
                    (
                        q(f"sum(increase(offpolicy_actor_reloads_total{A}[{RATE}]))", "reloads"),
                        q(
                            f"sum by (reason) (increase(offpolicy_actor_reload_failures_total{A}[{RATE}]))",
                            "failed: {{reason}}",
                        ),
                    ),
                ),
            ),
        ),
        (
            "Rewards and waiting",
            (
                Panel(
                    "Reward of generated completions (mean)",
                    (q(mean_of("offpolicy_actor_reward", "instance", A), "{{instance}}"),),
                ),
                Panel(
                    "Time waiting on the buffer, by reason",
                    (
                        q(
                            f"sum by (reason) (rate(offpolicy_actor_buffer_wait_seconds_total{A}[{RATE}]))",
                            "{{reason}}",
                        ),
                    ),
                    unit="percentunit",
                    description="Share of wall time the actors are held back (pacing, limiter, Redis down).",
                ),
                Panel(
                    "Engine call time p90",
                    (q(p90("offpolicy_actor_generate_seconds", "instance", A), "{{instance}}"),),
                    unit="s",
                ),
            ),
        ),
    ),
)

# --- Learner: loss, grad norm, step time by phase

LEARNER = DashboardSpec(
    uid="offpolicy-learner",
    title="offpolicy / Learner",
    description="The learner's optimisation: loss, gradient norm, learning rate, step time by phase.",
    rows=(
        (
            "Optimisation",
            (
                Panel("Loss", (q("avg(offpolicy_learner_loss)", "policy loss"),)),
                Panel(
                    "Gradient norm (before clipping)", (q("avg(offpolicy_learner_grad_norm)", "grad norm"),)
                ),
                Panel("Learning rate", (q("avg(offpolicy_learner_learning_rate)", "lr"),)),
            ),
        ),
        (
            "Step time",
            (
                Panel(
                    "Mean time per phase",
                    (q(mean_of("offpolicy_learner_step_phase_seconds", "phase"), "{{phase}}"),),
                    unit="s",
                ),
                Panel(
                    "Step time p50 / p90",
                    (
                        q(
                            "histogram_quantile(0.5, sum by (le) "
                            f"(rate(offpolicy_learner_step_seconds_bucket[{RATE}])))",
                            "p50",
                        ),
                        q(p90("offpolicy_learner_step_seconds"), "p90"),
                    ),
                    unit="s",
                ),
                Panel(
                    "Share of time waiting for samples",
                    (
                        q(
                            'sum(rate(offpolicy_learner_step_phase_seconds_sum{phase="sample_wait"}'
                            f"[{RATE}])) / sum(rate(offpolicy_learner_step_seconds_sum[{RATE}]))",
                            "sample wait",
                        ),
                    ),
                    unit="percentunit",
                ),
            ),
        ),
        (
            "Output",
            (
                Panel(
                    "Tokens and groups trained / s",
                    (
                        q(f"sum(rate(offpolicy_learner_tokens_total[{RATE}]))", "tokens/s"),
                        q(f"sum(rate(offpolicy_learner_groups_total[{RATE}]))", "groups/s"),
                    ),
                ),
                Panel(
                    "Publishes and checkpoints",
                    (
                        q(f"sum(increase(offpolicy_learner_publishes_total[{RATE}]))", "publishes"),
                        q(f"sum(increase(offpolicy_learner_checkpoints_total[{RATE}]))", "checkpoints"),
                    ),
                ),
                Panel(
                    "Response length (tokens)",
                    (q("avg(offpolicy_learner_response_length_tokens)", "mean length"),),
                ),
            ),
        ),
    ),
)

DASHBOARDS = (OVERVIEW, CORRECTION, BUFFER, ACTORS, LEARNER)

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
