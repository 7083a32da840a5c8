"""The data-pipeline dashboards: Buffer (size, insert / sample rates, drops, rate limiting) and Actors
(tokens/s, version lag, reloads).

Every metric named here is declared in `buffer/metrics.py`, `learner/metrics.py` or `actors/metrics.py`
(tests/unit/deploy/test_dashboards.py checks it).
"""

from __future__ import annotations

from deploy.dashboards.panels import RATE, DashboardSpec, Panel, Variable, mean_of, p90, q

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
        (
            "Delivery",
            (
                Panel(
                    "Leases",
                    (
                        q(f"sum(rate(offpolicy_buffer_leased_total[{RATE}]))", "leased/s"),
                        q(f"sum(rate(offpolicy_buffer_acked_total[{RATE}]))", "acked/s"),
                        q(f"sum(rate(offpolicy_buffer_redelivered_total[{RATE}]))", "redelivered/s"),
                    ),
                    unit="ops",
                    description="Acked: the use counts. Redelivered: a lease released or expired.",
                    width=12,
                ),
                Panel(
                    "Set aside (dead letters)",
                    (
                        q(
                            "sum by (reason) (increase(offpolicy_buffer_drops_total"
                            f'{{reason=~"invalid.*"}}[{RATE}]))',
                            "{{reason}}",
                        ),
                        q(
                            f"sum by (field) (increase(offpolicy_learner_groups_rejected_total[{RATE}]))",
                            "learner: {{field}}",
                        ),
                    ),
                    description="Groups that could not be trained (GET /v1/dead_letters lists them).",
                    width=12,
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
                    "Reload duration p90 and generation pause per update p90",
                    (
                        q(p90("offpolicy_actor_reload_seconds", "instance", A), "load {{instance}}"),
                        q(p90("offpolicy_actor_reload_pause_seconds", "instance", A), "pause {{instance}}"),
                    ),
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
        (
            "Evaluation and agents",
            (
                Panel(
                    "Held-out reward and pass@k by evaluated version",
                    (
                        q(f"max(offpolicy_actor_eval_reward_mean{A})", "reward (mean)"),
                        q(f"max by (k) (offpolicy_actor_eval_pass_at{A})", "pass@{{k}}"),
                    ),
                    description="The last evaluation of the held-out set (`eval` section); its version: "
                    "offpolicy_actor_eval_policy_version.",
                ),
                Panel(
                    "Evaluated policy version",
                    (q(f"max(offpolicy_actor_eval_policy_version{A})", "version"),),
                ),
                Panel(
                    "Gateway episodes",
                    (
                        q(
                            f"sum by (event) (rate(offpolicy_actor_gateway_episodes_total{A}[{RATE}]))",
                            "{{event}}",
                        ),
                        q(f"sum(offpolicy_actor_gateway_open_episodes{A})", "open"),
                    ),
                    unit="ops",
                ),
            ),
        ),
    ),
)
