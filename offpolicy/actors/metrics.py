"""Prometheus metrics of the actor (`offpolicy_actor_*`), declared on an injected CollectorRegistry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from offpolicy.buffer.evaluations import EvalRecord

FAILURE_REASONS = (
    "reward_error",  # the reward function raised or returned a non-finite value: the group is dropped
    "prompt_too_long",  # prompt + max_tokens does not fit in max_model_len: the prompt is skipped
    "invalid_group",  # the buffer rejected a group as invalid (a bug: logged with the field)
    "redis_unavailable",  # an insert / pacing check / policy read could not reach Redis (retried)
    "dropped_on_stop",  # generated groups not pushed because the actor was stopped while Redis was down
    "engine_error",  # vLLM refused or failed one prompt's request: the prompt is skipped, the loop goes on
)
REWARD_FAILURE_REASONS = (  # why a group's reward failed (RewardError.reason); each also counts reward_error
    "no_answer",  # the record has no reference answer and the reward needs one (data)
    "bad_answer",  # the reference answer cannot be read (math_answer: neither a number nor an expression)
    "raised",  # the reward function raised
    "not_finite",  # it returned something that is not a finite number
    "timeout",  # no rewards within reward.timeout_s
    "wrong_count",  # a batched function returned a list of the wrong length
    "remote",  # the verifier was unreachable or answered badly after its retries
    "environment",  # an environment's episode failed
)
RELOAD_FAILURE_REASONS = ("missing", "checksum", "timeout", "engine", "restore", "kind")
WAIT_REASONS = ("pacing", "rate_limited", "redis_unavailable", "buffer_full")
EPISODE_EVENTS = (
    "opened",  # POST /v1/episodes
    "finished",  # POST /v1/episodes/{id}/finish
    "expired",  # no call or finish for gateway.episode_timeout_s
    "empty",  # finished or expired without a policy turn: not part of its group's record
)
GATEWAY_SECONDS = ("request", "engine")  # a chat call's time in the handler; the engine's share of it
# The first bound must be >= 0 or prometheus_client drops `_sum` (dashboards use sum/count): negative
# rewards (length penalty) all land in the `le="0.0"` bucket.
_REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0)
_RELOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_PAUSE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
_BATCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ActorMetrics:
    """All metrics of one actor process; labels are bounded (reasons), never ids or versions."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.tokens = Counter(
            "offpolicy_actor_generated_tokens_total", "Completion tokens generated", registry=r
        )
        self.tokens_per_s = Gauge(
            "offpolicy_actor_tokens_per_second",
            "Completion tokens per second over the last few seconds",
            registry=r,
        )
        self.batch_seconds = Histogram(
            "offpolicy_actor_generate_seconds", "Wall time of one prompt's request (its n completions)",
            buckets=_BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.groups_pushed = Counter(
            "offpolicy_actor_groups_pushed_total", "Groups inserted into the buffer", registry=r
        )
        self.duplicates = Counter(
            "offpolicy_actor_duplicate_groups_total", "Inserts the buffer ignored (group_id seen)", registry=r
        )
        self.failures = Counter(
            "offpolicy_actor_failures_total", "Failures by reason (see actors/metrics.py)", ["reason"],
            registry=r,
        )  # fmt: skip
        self.reward_failures = Counter(
            "offpolicy_actor_reward_failures_total",
            "Groups set aside because their reward failed, by reason (see actors/metrics.py)", ["reason"],
            registry=r,
        )  # fmt: skip
        self.reward_failure_alarm = Gauge(
            "offpolicy_actor_reward_failure_alarm",
            "1 while more than half of the groups failed their reward (judged after the first 20), else 0",
            registry=r,
        )
        self.run_failed = Gauge(
            "offpolicy_actor_run_failed",
            "1 once the run's loop died (GET /v1/runs says why; DELETE /v1/runs/{run_id} frees its share), "
            "else 0",
            registry=r,
        )
        self.reward = Histogram(
            "offpolicy_actor_reward", "Reward of each scored completion", buckets=_REWARD_BUCKETS, registry=r
        )
        self.policy_version = Gauge(
            "offpolicy_actor_policy_version", "Policy version of the weights in the engine", registry=r
        )
        self.learner_version = Gauge(
            "offpolicy_actor_learner_policy_version", "Newest policy version in the policy record", registry=r
        )
        self.policy_lag = Gauge(
            "offpolicy_actor_policy_lag_versions", "Learner's published version minus the loaded one",
            registry=r,
        )  # fmt: skip
        self.reloads = Counter("offpolicy_actor_reloads_total", "Successful weight reloads", registry=r)
        self.adapter_loads = Counter(
            "offpolicy_actor_adapter_loads_total",
            "LoRA adapters registered with the engine (engine.lora; the base model is not reloaded)",
            registry=r,
        )
        self.adapters = Gauge(
            "offpolicy_actor_adapters_loaded",
            "LoRA adapters the engine holds now: the newest and those of requests still in flight",
            registry=r,
        )
        self.reload_seconds = Histogram(
            "offpolicy_actor_reload_seconds",
            "Engine paused for one successful weight load (the load into the engine; checks and prefetch "
            "run before)", buckets=_RELOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.reload_prefetch = Histogram(
            "offpolicy_actor_reload_prefetch_seconds",
            "Checking and reading a new version's files ahead of its load, while the engine generates",
            buckets=_RELOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefetched_bytes = Counter(
            "offpolicy_actor_reload_prefetched_bytes_total",
            "Bytes of published weights read ahead of their load, by where they went", ["where"], registry=r,
        )  # fmt: skip
        self.reload_pause = Histogram(
            "offpolicy_actor_reload_pause_seconds",
            "Generation held back by one weight update: engine pause (inflight), abort + load (abort), "
            "drain + load (drain)", buckets=_PAUSE_BUCKETS, registry=r,
        )  # fmt: skip
        self.aborted_tokens = Counter(
            "offpolicy_actor_aborted_tokens_total", "Tokens thrown away by reload.mode=abort", registry=r
        )
        self.inflight = Gauge(
            "offpolicy_actor_inflight_prompts", "Prompts in the engine now (requests of n completions)",
            registry=r,
        )  # fmt: skip
        self.reload_failures = Counter(
            "offpolicy_actor_reload_failures_total", "Failed weight loads by reason", ["reason"], registry=r
        )
        self.buffer_wait = Counter(
            "offpolicy_actor_buffer_wait_seconds_total",
            "Seconds spent waiting on the buffer (pacing, rate limiter, Redis down, buffer full)", ["reason"],
            registry=r,
        )  # fmt: skip
        self.episodes = Counter(
            "offpolicy_actor_gateway_episodes_total", "Gateway episodes by event (see actors/metrics.py)",
            ["event"], registry=r,
        )  # fmt: skip
        self.chat_calls = Counter(
            "offpolicy_actor_gateway_chat_calls_total",
            "Chat completions served by the gateway; recorded = within an episode", ["recorded"], registry=r,
        )  # fmt: skip
        self.gateway_seconds = Counter(
            "offpolicy_actor_gateway_seconds_total",
            "Seconds of gateway chat calls: `request` (the handler) and `engine` (generation within it)",
            ["part"], registry=r,
        )  # fmt: skip
        self.open_episodes = Gauge(
            "offpolicy_actor_gateway_open_episodes", "Gateway episodes opened and not finished", registry=r
        )
        self.eval_reward = Gauge(
            "offpolicy_actor_eval_reward_mean",
            "Mean reward of the last evaluation on the held-out set",
            registry=r,
        )
        self.eval_pass = Gauge(
            "offpolicy_actor_eval_pass_at", "pass@k of the last evaluation (k = 1 and samples_per_prompt)",
            ["k"], registry=r,
        )  # fmt: skip
        self.eval_version = Gauge(
            "offpolicy_actor_eval_policy_version", "Policy version of the last evaluation", registry=r
        )
        self.evals = Counter("offpolicy_actor_evals_total", "Evaluations run on the held-out set", registry=r)
        for event in EPISODE_EVENTS:
            self.episodes.labels(event)
        for part in GATEWAY_SECONDS:
            self.gateway_seconds.labels(part)
        for recorded in ("true", "false"):
            self.chat_calls.labels(recorded)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        for reason in REWARD_FAILURE_REASONS:
            self.reward_failures.labels(reason)
        for reason in RELOAD_FAILURE_REASONS:
            self.reload_failures.labels(reason)
        for reason in WAIT_REASONS:
            self.buffer_wait.labels(reason)
        for where in ("memory", "page_cache"):
            self.prefetched_bytes.labels(where)

    def record_eval(self, record: EvalRecord) -> None:
        """Set the evaluation gauges from one evaluation."""
        self.eval_reward.set(record.reward_mean)
        for k, value in record.pass_at.items():
            self.eval_pass.labels(k).set(value)
        self.eval_version.set(record.policy_version)
        self.evals.inc()
