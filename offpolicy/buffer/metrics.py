"""Prometheus metrics of the buffer (`offpolicy_buffer_*`), declared on an injected CollectorRegistry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
# Every field InvalidTrajectory names, indices stripped (buffer/codec.py): the bounded `field` label set.
REJECTED_FIELDS = (
    "payload", "schema_version", "group_id", "prompt_id", "actor_id", "policy_version", "created_at",
    "prompt_ids", "trajectories", "trajectories.response_ids", "trajectories.behavior_logprobs",
    "trajectories.versions", "trajectories.policy_mask", "trajectories.reward", "trajectories.finish_reason",
    "priority", "metadata",
    "sampling",
)  # fmt: skip
EVICTION_REASONS = ("max_size", "max_times_sampled", "max_bytes")
FULL_REASONS = ("max_bytes", "maxmemory")  # why an insert was refused with BufferFull
DROP_REASONS = ("stale", "evicted_unsampled", "payload_missing")
# Groups set aside to the dead-letter list: `invalid:<field>`, field from REJECTED_FIELDS or `other`.
INVALID_REASONS = tuple(f"invalid:{f}" for f in (*REJECTED_FIELDS, "other"))
WAIT_OPS = ("insert", "sample", "pace")


class BufferMetrics:
    """All buffer metrics of one process; build one per registry (learner and actor each have their own).

    Every known label child is created here, so each series is exported (at 0) before its first event,
    and the hot path uses the cached children (`evicted_max_size`, `dropped_stale`, `waits["insert"]`...)
    instead of a label lookup per call.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.size = Gauge(
            "offpolicy_buffer_size_groups", "Groups stored in the buffer (last seen)", registry=registry
        )
        self.fill_ratio = Gauge(
            "offpolicy_buffer_fill_ratio", "Groups stored / max_size (last seen)", registry=registry
        )
        self.inserts = Counter(
            "offpolicy_buffer_inserts_total", "Groups inserted (new group_id)", registry=registry
        )
        self.duplicates = Counter(
            "offpolicy_buffer_duplicates_total", "Inserts that were no-ops (group_id seen)", registry=registry
        )
        self.rejected = Counter(
            "offpolicy_buffer_rejected_total", "Groups rejected as invalid, by field", ["field"],
            registry=registry,
        )  # fmt: skip
        self.samples = Counter(
            "offpolicy_buffer_samples_total", "Groups handed out by sample", registry=registry
        )
        self.evictions = Counter(
            "offpolicy_buffer_evictions_total",
            "Groups removed by the remover, by reason (max_size, max_times_sampled, max_bytes: used groups "
            "evicted to make room for bytes)",
            ["reason"],
            registry=registry,
        )
        self.drops = Counter(
            "offpolicy_buffer_drops_total",
            "Groups lost before use or too stale to use, by reason "
            "(stale, evicted_unsampled, payload_missing, invalid:<field>: set aside as dead letters)",
            ["reason"],
            registry=registry,
        )
        self.leased = Counter(
            "offpolicy_buffer_leased_total", "Groups handed out by lease (one per lease)", registry=registry
        )
        self.acked = Counter(
            "offpolicy_buffer_acked_total", "Leases acknowledged (their use counts)", registry=registry
        )
        self.redelivered = Counter(
            "offpolicy_buffer_redelivered_total",
            "Leases ended without an ack (released, or expired when seen by this process): use returned",
            registry=registry,
        )
        self.rate_limited_waits = Counter(
            "offpolicy_buffer_rate_limited_waits_total",
            "Backoff waits because a limiter said no, by operation (insert, sample, pace)",
            ["op"],
            registry=registry,
        )
        self.payload_bytes = Gauge(
            "offpolicy_buffer_payload_bytes", "Payload bytes of the stored groups, leased ones included "
            "(last seen by an insert)", registry=registry,
        )  # fmt: skip
        self.full = Counter(
            "offpolicy_buffer_full_total",
            "Insert calls refused with BufferFull (back-pressure), by reason (max_bytes: the buffer's byte "
            "budget; maxmemory: Redis' own out-of-memory refusal)",
            ["reason"],
            registry=registry,
        )
        self.storage_retries = Counter(
            "offpolicy_buffer_storage_retries_total", "Redis calls retried after a connection error",
            registry=registry,
        )  # fmt: skip
        self.sampled_staleness = Histogram(
            "offpolicy_buffer_sampled_staleness_versions",
            "consumer_version - policy_version of each sampled group",
            buckets=_STALENESS_BUCKETS,
            registry=registry,
        )
        self.insert_latency = Histogram(
            "offpolicy_buffer_insert_latency_seconds", "insert/insert_many call time, waits included",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.sample_latency = Histogram(
            "offpolicy_buffer_sample_latency_seconds", "sample call time, waits included",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        for f in REJECTED_FIELDS:
            self.rejected.labels(f)
        self.evicted_max_size = self.evictions.labels("max_size")
        self.evicted_max_times_sampled = self.evictions.labels("max_times_sampled")
        self.evicted_max_bytes = self.evictions.labels("max_bytes")
        self.full_by = {r: self.full.labels(r) for r in FULL_REASONS}
        self.dropped_stale = self.drops.labels("stale")
        self.dropped_evicted_unsampled = self.drops.labels("evicted_unsampled")
        self.dropped_payload_missing = self.drops.labels("payload_missing")
        self.dropped_invalid = {r: self.drops.labels(r) for r in INVALID_REASONS}
        self.waits = {op: self.rate_limited_waits.labels(op) for op in WAIT_OPS}
