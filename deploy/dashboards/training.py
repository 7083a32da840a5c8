"""The training-side dashboards: Overview (throughput, versions, reward, staleness), Off-policy
correction (IS / ESS / chi2 / KL / RS, KL by staleness bucket) and Learner (loss, step time by phase).

Every metric named here is declared in `buffer/metrics.py`, `learner/metrics.py` or `actors/metrics.py`
(tests/unit/deploy/test_dashboards.py checks it).
"""

from __future__ import annotations

from deploy.dashboards.control import CONTROL_ROW
from deploy.dashboards.moe import MOE_ROW
from deploy.dashboards.panels import LC, RATE, DashboardSpec, Panel, mean_of, p90, q

# --- the running config: on the Overview and the Learner dashboards (every change is also an annotation)

CONFIG_ROW = (
    "Running config",
    (
        Panel(
            "Config version",
            (q("max by (run_id) (offpolicy_learner_config_version)", "{{run_id}}"),),
            kind="stat",
            width=6,
            description="config_version of the config the learner trains with (GET /v1/config); every "
            "applied change moves it and draws a `Config changes` marker on the graphs.",
        ),
        Panel(
            "Active rollout-correction preset",
            (q("max by (preset) (offpolicy_learner_config_info)", "{{preset}}"),),
            kind="stat",
            width=12,
            text_mode="name",
            description="The preset the running config's rollout_correction equals (`custom`: none).",
        ),
        Panel(
            "Max staleness (steps)",
            (q("max by (run_id) (offpolicy_learner_max_staleness_steps)", "{{run_id}}"),),
            kind="stat",
            width=6,
            description="The running buffer.max_staleness; Infinity = unbounded.",
        ),
    ),
)

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
                Panel(
                    "Actors up",
                    (q('count(up{job="actor"} == 1 and on (instance, job) offpolicy_actor_policy_version)'),),
                    kind="stat",
                    width=4,
                    description="Actor targets Prometheus scrapes that export the selected runs' metrics.",
                ),
                Panel("Learner paused", (q("max(offpolicy_learner_paused)"),), kind="stat", width=4),
            ),
        ),
        CONFIG_ROW,
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
        CONTROL_ROW,
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
        MOE_ROW,
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


# --- Learner: loss, grad norm, step time by phase

LEARNER = DashboardSpec(
    uid="offpolicy-learner",
    title="offpolicy / Learner",
    description="The learner's optimisation: loss (policy gradient, KL to the reference), entropy, "
    "gradient norm, learning rate, step time by phase.",
    rows=(
        CONFIG_ROW,
        (
            "Optimisation",
            (
                Panel(
                    "Loss",
                    (
                        q("avg(offpolicy_learner_loss)", "policy loss"),
                        q("avg(offpolicy_learner_actor_pg_loss)", "pg_loss"),
                        q("avg(offpolicy_learner_actor_kl_loss)", "kl_loss (to the reference)"),
                    ),
                ),
                Panel("Policy entropy", (q("avg(offpolicy_learner_actor_entropy)", "entropy"),)),
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
        (
            "Background writes",
            (
                Panel(
                    "Published version lag",
                    (q("max(offpolicy_learner_published_lag_versions)", "lag (versions)"),),
                    description="Trained policy version minus the newest version announced to the actors.",
                ),
                Panel(
                    "Background write time p90",
                    (
                        q(
                            "histogram_quantile(0.9, sum by (le, kind) "
                            f"(rate(offpolicy_learner_background_write_seconds_bucket[{RATE}])))",
                            "{{kind}}",
                        ),
                    ),
                    unit="s",
                ),
                Panel(
                    "Coalesced snapshots and lost leases",
                    (
                        q(f"sum(increase(offpolicy_learner_writes_coalesced_total[{RATE}]))", "coalesced"),
                        q(f"sum(increase(offpolicy_learner_leases_lost_total[{RATE}]))", "leases lost"),
                    ),
                ),
                Panel(
                    "Failed writes",
                    (
                        q(
                            "sum by (kind, reason) "
                            f"(increase(offpolicy_learner_write_failures_total[{RATE}]))",
                            "{{kind}} {{reason}}",
                        ),
                        q("max(offpolicy_learner_undurable_steps)", "steps not checkpointed"),
                        q("max(offpolicy_learner_intake_blocked)", "intake stopped"),
                    ),
                    description="Publishes and checkpoints that failed (ENOSPC, EIO: retried with backoff "
                    "while training goes on; /v1/status names the path), the learner steps not covered by "
                    "a durable checkpoint, and 1 while checkpoint.max_undurable_steps stops intake.",
                ),
                Panel(
                    "Age of the newest checkpoint and published version",
                    (
                        q("max(offpolicy_learner_checkpoint_age_seconds)", "checkpoint"),
                        q("max(offpolicy_learner_published_age_seconds)", "published version"),
                    ),
                    unit="s",
                ),
            ),
        ),
    ),
)
