"""The learner's Prometheus metrics (`LearnerMetrics`, on an injected registry) and the last step's dict.

Every metric the learner exports is declared here but the transfer metrics (`offpolicy_learner_transfer*`,
`publish.transport: vllm`): those are `TransferMetrics` in transport/publisher.py, next to their one user,
as the actor declares its receiver's in actors/transport/receiver.py. Names follow
`offpolicy_learner_<what>_<unit>`. Each `rollout_corr/<key>` of the spec (section 6) is a gauge
`offpolicy_learner_rollout_corr_<key>`, declared up front for every key the correction can emit (so
dashboards may name them before the first step); a key outside that list still gets a gauge on first
sight. Token-level histograms (IS weights, staleness) are filled from whole arrays at once by
`BulkHistogram`, never by one `observe` per token. Also here: `timed` (a step's critical-path phases),
`metric_sums` (a step's metric tensors moved to the host at once) and `json_safe` (a step's dict with NaN
as null: `last`, and the JSONL sink's lines).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

PREFIX = "offpolicy_learner_"
PHASES = (
    "sample_wait", "collate", "old_logprob", "ref_logprob", "teacher_logprob", "forward_backward",
    "optimizer", "publish", "checkpoint",
)  # fmt: skip
"""Critical-path phases of a step; `publish` and `checkpoint` are the host snapshots only (the writes run
on the background writer and are timed by `offpolicy_learner_background_write_seconds`)."""
STALENESS_BUCKETS = ("0", "1", "2-3", "4-7", "8+")

IS_KEYS = (
    "mean", "max", "min", "ratio_fraction_high", "ratio_fraction_low", "std", "eff_sample_size",
    "seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
    "seq_fraction_low", "oob_ratio", "batch_norm_factor", "veto_fraction", "catastrophic_token_fraction",
)  # fmt: skip
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip
RS_KEYS = (
    "mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean", "seq_std", "seq_max",
    "seq_min", "seq_max_deviation", "seq_fraction_high", "seq_fraction_low", "masked_fraction",
    "seq_masked_fraction",
)  # fmt: skip
OFFPOLICY_KEYS = (
    "training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
)  # fmt: skip
ROLLOUT_CORR_KEYS = (
    *(f"rollout_is_{k}" for k in IS_KEYS),
    "rollout_rs_masked_fraction",
    "rollout_rs_seq_masked_fraction",
    *(f"rollout_rs_{o}_{k}" for o in RS_OPTIONS for k in RS_KEYS),
    *OFFPOLICY_KEYS,
)
ACTOR_KEYS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss")
CRITIC_KEYS = ("vf_loss", "vf_clipfrac", "values_mean")
SCALARS = {  # step-dict key -> (metric name suffix, help)
    "loss": ("loss", "Policy loss of the last learner step (mean over its optimizer steps)."),
    "grad_norm": ("grad_norm", "Global gradient norm before clipping (last optimizer step)."),
    "lr": ("learning_rate", "Learning rate of the last optimizer step."),
    "tokens_per_s": ("tokens_per_second", "Response tokens trained per second over the last step."),
    "version": ("policy_version", "Policy version = optimizer steps taken."),
    "reward_mean": ("reward_mean", "Mean reward of the completions in the last sampled batch."),
    "response_length_mean": ("response_length_tokens", "Mean response length of the last batch."),
    "staleness_mean": ("staleness_mean_steps", "Mean staleness of the last batch's groups."),
    "published_lag": (
        "published_lag_versions",
        "Trained policy version minus the newest version published to the actors (background writer lag).",
    ),
    "moe/aux_loss": ("moe_aux_loss", "Load-balancing loss of an MoE policy's routers (last step)."),
    "moe/z_loss": ("moe_z_loss", "Router z-loss of an MoE policy (last step)."),
    "moe/router_agreement": (
        "moe_router_agreement",
        "Share of token-layers whose learner top-k equals the rollout's (or, under replay, the replayed) "
        "experts, last step (MoE groups with routed experts).",
    ),
    "moe/logprob_gap": (
        "moe_logprob_gap",
        "Mean |log pi_theta - log mu| over the last step's response tokens (MoE groups with routed experts).",
    ),
}
MOE_BY_STALENESS = ("router_agreement", "logprob_gap")
"""`moe/<key>/<bucket>` of a step: gauges `offpolicy_learner_moe_<key>_by_staleness{staleness}`."""
REJECTION_FIELDS = (
    "sampling.temperature", "prompt_ids", "trajectories.response_ids", "trajectories.behavior_logprobs",
)  # fmt: skip
"""The `field` labels of `groups_rejected_total` (learner/rl/screening.py, list indices dropped)."""
DROP_REASONS = ("zero_variance", "all_truncated")
"""The `reason` labels of `groups_dropped_total` (learner/rl/dynamic_sampling.py)."""
TRACKING_SINKS = ("jsonl", "tensorboard", "wandb", "mlflow")
"""The `sink` labels of `tracking_errors_total` (learner/tracking/)."""
WRITE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
IS_WEIGHT_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
STALENESS_HIST_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


# --- timing and reduction of a step


@contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the block to `phases[name]` (seconds), the GPU work it queued included: it
    waits on an event recorded on the current (compute) stream, not for the whole device, so the host
    copies of a publish on their side stream go on overlapping."""
    t0 = time.perf_counter()
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        done = torch.cuda.Event()
        done.record()  # the current stream of the current device
        done.synchronize()
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


def metric_sums(acc: dict[str, list[torch.Tensor]]) -> dict[str, tuple[float, int]]:
    """(sum, count) of each metric's 0-d tensors, moved to the host in one transfer (their means, reduced
    across ranks: `distributed.reduce_means`)."""
    if not acc:
        return {}
    names = list(acc)
    sums = torch.stack([torch.stack([v.float().reshape(()) for v in acc[n]]).sum() for n in names])
    return {n: (s, len(acc[n])) for n, s in zip(names, sums.cpu().tolist(), strict=True)}


# --- Prometheus


def sanitize(key: str) -> str:
    """A metric-name-safe form of a metric key: lower case, runs of other characters become `_`."""
    return re.sub(r"[^a-z0-9_]+", "_", key.lower()).strip("_")


class BulkHistogram(Collector):
    """A Prometheus histogram filled from whole arrays (`observe_many`), one numpy pass per call."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = np.asarray(sorted(buckets), dtype=np.float64)
        self.counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)
        self.total = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64).ravel()
        idx = np.searchsorted(self.bounds, values, side="left")  # first bound >= value: Prometheus `le`
        with self._lock:
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.total += float(values.sum())

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            cum, total = np.cumsum(self.counts), self.total
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cum[:-1], strict=True)]
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], [*buckets, ("+Inf", int(cum[-1]))], total)
        return [family]


class LearnerMetrics:
    """The learner's metrics on `registry`; `last` is the last step's metrics as a plain dict."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.last: dict[str, float] = {}
        self._gauges: dict[str, Gauge] = {}
        self._lock = threading.Lock()
        for key in ROLLOUT_CORR_KEYS:
            self._gauge(f"rollout_corr/{key}")
        for key in ACTOR_KEYS:
            self._gauge(f"actor/{key}")
        for key in CRITIC_KEYS:
            self._gauge(f"critic/{key}")
        for key in SCALARS:
            self._gauge(key)
        self.steps = Counter(PREFIX + "steps", "Learner steps completed.", registry=registry)
        self.tokens = Counter(PREFIX + "tokens", "Response tokens trained on.", registry=registry)
        self.groups = Counter(PREFIX + "groups", "Groups sampled and trained on.", registry=registry)
        self.steps_skipped = Counter(
            PREFIX + "optimizer_steps_skipped",
            "Optimizer steps skipped for a non-finite gradient norm (weights and AdamW state unchanged).",
            registry=registry,
        )
        self.publishes = Counter(PREFIX + "publishes", "Weight versions published.", registry=registry)
        self.checkpoints = Counter(PREFIX + "checkpoints", "Checkpoints written.", registry=registry)
        self.publish_delta_share = Gauge(
            PREFIX + "publish_delta_share",
            "publish.delta: bytes of the newest published version over a full version's (1 when whole).",
            registry=registry,
        )
        self.groups_rejected = Counter(
            PREFIX + "groups_rejected", "Sampled groups the model cannot train (set aside), by field.",
            ["field"], registry=registry,
        )  # fmt: skip
        for field in REJECTION_FIELDS:  # declared at 0 so that dashboards have a series before the first one
            self.groups_rejected.labels(field=field)
        self.groups_dropped = Counter(
            PREFIX + "groups_dropped", "Sampled groups dynamic sampling did not train (acked), by reason.",
            ["reason"], registry=registry,
        )  # fmt: skip
        for reason in DROP_REASONS:
            self.groups_dropped.labels(reason=reason)
        self.leases_lost = Counter(
            PREFIX + "leases_lost", "Trained groups whose lease expired before its ack (they train again).",
            registry=registry,
        )  # fmt: skip
        self.write_seconds = Histogram(
            PREFIX + "background_write_seconds", "Time the background writer took per job (until durable).",
            ["kind"], buckets=WRITE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.writes_coalesced = Counter(
            PREFIX + "writes_coalesced", "Snapshots replaced by a newer one before the writer reached them.",
            registry=registry,
        )  # fmt: skip
        self.write_failures = Counter(
            PREFIX + "write_failures",
            "Background writes (publish, checkpoint) that failed, by kind and reason (an errno name such as "
            "ENOSPC or EIO: retried with backoff; any other name: a bug, the loop ends).",
            ["kind", "reason"],
            registry=registry,
        )
        for kind in ("weights", "checkpoint"):
            self.write_failures.labels(kind=kind, reason="ENOSPC")
        self.checkpoint_age = Gauge(
            PREFIX + "checkpoint_age_seconds",
            "Seconds since the newest durable checkpoint was written (since the start when there is none).",
            registry=registry,
        )
        self.published_age = Gauge(
            PREFIX + "published_age_seconds",
            "Seconds since the newest version was published to the actors (since the start when none was).",
            registry=registry,
        )
        self.undurable_steps = Gauge(
            PREFIX + "undurable_steps",
            "Learner steps not covered by a durable checkpoint (a crash trains them again); capped by "
            "checkpoint.max_undurable_steps.",
            registry=registry,
        )
        self.checkpoint_every = Gauge(
            PREFIX + "checkpoint_every_steps",
            "The running config's checkpoint.checkpoint_every (0 = only on demand, or no checkpoints).",
            registry=registry,
        )
        self.intake_blocked = Gauge(
            PREFIX + "intake_blocked", "1 while the learner takes no new groups: checkpoints are failing and "
            "checkpoint.max_undurable_steps is reached.", registry=registry,
        )  # fmt: skip
        self.tracking_errors = Counter(
            PREFIX + "tracking_errors", "Failed calls to an experiment tracker (the step went on), by sink.",
            ["sink"], registry=registry,
        )  # fmt: skip
        for sink in TRACKING_SINKS:
            self.tracking_errors.labels(sink=sink)
        self.paused = Gauge(PREFIX + "paused", "1 while the learner is paused, else 0.", registry=registry)
        self.transfer_stuck = Counter(
            PREFIX + "transfer_stuck", "Weight-transfer sends and group teardowns that outlived their "
            "bound (a hung rendezvous, collective or device sync; publish.transport: vllm): sends fail at "
            "once until it ends, the actors go on with file generations.", registry=registry,
        )  # fmt: skip
        self.nccl_net = Gauge(
            PREFIX + "nccl_net_info", "1 for the network NCCL can use between the nodes of a multi-node CUDA "
            "learner, as read at start (learner/distributed/nccl_net.py): ib, plugin:<name> or socket.",
            ["net"], registry=registry,
        )  # fmt: skip
        self.start_way = Gauge(
            PREFIX + "start_way_info", "1 for how this learner read its policy weights at start: slices "
            "(lean start, each rank its own), broadcast (lean start, rank 0 read the whole checkpoint), "
            "whole (one process) or whole, sharded (every rank read it all).",
            ["way"], registry=registry,
        )  # fmt: skip
        self.config_version = Gauge(
            PREFIX + "config_version", "config_version (GET /v1/config/history) of the config the loop runs.",
            registry=registry,
        )  # fmt: skip
        self.config_info = Gauge(
            PREFIX + "config_info", "1 for the config the loop runs: its config_version and the name of its "
            "rollout-correction preset (`custom` when it matches none); one series at a time.",
            ["config_version", "preset"], registry=registry,
        )  # fmt: skip
        self._info_labels: tuple[str, str] | None = None
        self.max_staleness = Gauge(
            PREFIX + "max_staleness_steps", "The staleness bound in force: the running config's "
            "buffer.max_staleness, or the controller's under `control.mode: auto` (+Inf = unbounded): groups "
            "more than this many policy versions behind the learner are never sampled.",
            registry=registry,
        )  # fmt: skip
        self.control_auto = Gauge(
            PREFIX + "control_auto", "1 while `control.mode: auto` sets the staleness bound "
            "(max_staleness_steps), 0 when it is fixed or the controller fell back to it (no IS or mask "
            "metrics to judge by).",
            registry=registry,
        )  # fmt: skip
        self.control_changes = Counter(
            PREFIX + "control_changes", "Changes of the staleness bound by the controller, by reason "
            "(ess_below_floor, masked_above_ceiling, learner_waiting, start, mode_fixed, limits, "
            "missing_metrics).",
            ["reason"], registry=registry,
        )  # fmt: skip
        self.wait_share = Gauge(
            PREFIX + "wait_share", "Share of the learner's time spent waiting for data over the controller's "
            "last window (end of a step to the next step's groups in hand).",
            registry=registry,
        )  # fmt: skip
        self.actor_capacity_ratio = Gauge(
            PREFIX + "actor_capacity_ratio", "The actors the learner wants over the actors it has "
            "(1 = enough): its demand when fed over the usable groups/s the actors add, >= 1 while it "
            "waits, <= 1 while it does not; the autoscaler's input.",
            registry=registry,
        )  # fmt: skip
        self.actor_capacity_ratio.set(1.0)
        self.phase_seconds = Histogram(
            PREFIX + "step_phase_seconds", "Time per learner step phase.", ["phase"],
            buckets=PHASE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.step_seconds = Histogram(
            PREFIX + "step_seconds",
            "Wall time of one learner step.",
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.staleness_hist = BulkHistogram(
            PREFIX + "sampled_staleness_steps", "Staleness of sampled groups (learner - policy version).",
            STALENESS_HIST_BUCKETS, registry,
        )  # fmt: skip
        self.is_weight_hist = BulkHistogram(
            PREFIX + "token_is_weight", "Per-token importance weights applied (or, in bypass, computed).",
            IS_WEIGHT_BUCKETS, registry,
        )  # fmt: skip
        self.offpolicy_kl = Gauge(
            PREFIX + "offpolicy_kl",
            "k1 KL(pi_rollout || pi_train) over the last step's tokens, by staleness bucket (steps).",
            ["staleness"], registry=registry,
        )  # fmt: skip
        self.moe_by_staleness = {
            key: Gauge(
                f"{PREFIX}moe_{key}_by_staleness",
                f"{SCALARS['moe/' + key][1]} By staleness bucket (steps) of the tokens.",
                ["staleness"],
                registry=registry,
            )
            for key in MOE_BY_STALENESS
        }

    def _gauge(self, key: str) -> Gauge:
        with self._lock:
            if key not in self._gauges:
                suffix, doc = SCALARS.get(key, (sanitize(key), f"Last learner step's `{key}`."))
                self._gauges[key] = Gauge(PREFIX + suffix, doc, registry=self.registry)
            return self._gauges[key]

    def record_config(self, config_version: int, config: Any) -> None:
        """Set the config gauges when a config (a `LearnerConfig`) takes effect: at start and at the step
        boundary where a change is applied. `config_info` keeps one series, the running config's."""
        preset = config.rollout_correction.preset_name()
        self.config_version.set(config_version)
        labels = (str(config_version), preset)
        self.config_info.labels(*labels).set(1)
        if self._info_labels not in (None, labels):  # the previous config's series ends (marked stale)
            self.config_info.remove(*self._info_labels)
        self._info_labels = labels
        max_staleness = config.buffer.max_staleness
        self.max_staleness.set(float("inf") if max_staleness is None else max_staleness)
        every = config.checkpoint.checkpoint_every if config.checkpoint_path is not None else None
        self.checkpoint_every.set(every or 0)

    def record_step(self, step_metrics: Mapping[str, float], phases: Mapping[str, float]) -> None:
        """Set the gauges from one step's metrics dict and observe its phase times; keep the dict."""
        for key, value in step_metrics.items():
            if key.startswith(("eval/", "reward/")) and key.count("/") > 1:
                continue  # per data_source and a reward's own figures: the trackers' (unbounded names)
            if key.startswith(("rollout_corr/", "actor/", "critic/", "eval/", "distill/")) or key in SCALARS:
                self._gauge(key).set(value)
            elif key.startswith("moe/") and key.count("/") == 2:  # moe/<key>/<bucket>
                _, name, bucket = key.split("/")
                if name in self.moe_by_staleness and bucket in STALENESS_BUCKETS:
                    self.moe_by_staleness[name].labels(staleness=bucket).set(value)
        for phase, seconds in phases.items():
            self.phase_seconds.labels(phase=phase).observe(seconds)
        self.step_seconds.observe(sum(phases.values()))
        self.steps.inc()
        self.tokens.inc(step_metrics.get("tokens", 0.0))
        self.groups.inc(step_metrics.get("groups", 0.0))
        self.steps_skipped.inc(step_metrics.get("optimizer_steps_skipped", 0.0))
        for bucket in STALENESS_BUCKETS:
            if f"offpolicy_kl/{bucket}" in step_metrics:
                self.offpolicy_kl.labels(staleness=bucket).set(step_metrics[f"offpolicy_kl/{bucket}"])
        self.last = json_safe(step_metrics)


def json_safe(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """`metrics` with NaN and infinite floats as None (JSON's null: a loss gone NaN stays reportable)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
