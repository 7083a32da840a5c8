"""Buffer configuration as data: codec limits, table shape, sampler, rate limiter, pacing, waits."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from offpolicy.config.base import (
    MAX_AGE_S,
    MAX_BATCH,
    MAX_BYTES,
    MAX_COUNT,
    MAX_SEQ_TOKENS,
    MAX_WAIT_S,
    ConfigModel,
)

# Fields that belong to one producer or consumer, not to the table: the learner's changes never touch them.
LOCAL_FIELDS = frozenset(
    ["max_ahead", "insert_timeout_s", "backoff_initial_s", "backoff_max_s", "storage_timeout_s",
     "socket_timeout_s"]
)  # fmt: skip
Sampler = Literal["fifo", "newest", "uniform", "staleness_weighted", "prioritized"]


MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
"""The largest encoded group `max_payload_bytes` may allow: Redis' largest string (`proto-max-bulk-len`)."""


class CodecLimits(ConfigModel):
    """Limits `decode_group` / `validate_group` enforce; a group over any of them is `InvalidTrajectory`."""

    max_tokens_per_completion: int = Field(32_768, ge=1, le=MAX_SEQ_TOKENS)
    """Most response tokens in one trajectory."""
    max_prompt_tokens: int = Field(32_768, ge=1, le=MAX_SEQ_TOKENS)
    """Most prompt tokens in a group."""
    max_completions_per_group: int = Field(1_024, ge=1, le=MAX_BATCH)
    """Most trajectories in one group."""
    max_payload_bytes: int = Field(64 * 1024 * 1024, ge=1, le=MAX_PAYLOAD_BYTES)
    """Largest encoded group, in bytes."""
    max_images_per_group: int = Field(1_024, ge=0, le=MAX_BATCH)
    """Most image references in one group (`TrajectoryGroup.images`)."""


class BufferConfig(ConfigModel):
    """One replay table: Reverb's `max_size`, sampler, remover (`max_times_sampled`) and rate limiters."""

    max_size: int = Field(10_000, ge=1, le=MAX_COUNT)
    """Most groups stored; past it the oldest (by insert order) is evicted."""
    max_bytes: int | None = Field(None, ge=0, le=MAX_BYTES)
    """Most payload bytes stored (leased groups included); an insert past it raises `BufferFull`
    (back-pressure: the producer waits and retries). Groups sampled at least once are evicted, oldest
    first, to make room; a group nobody has trained on never is. None = `max_bytes_share` of Redis'
    `maxmemory` when one is set, else no bound; 0 = no bound."""
    max_bytes_share: float = Field(0.6, gt=0.0, le=0.9)
    """With `max_bytes` None: the share of Redis' `maxmemory` the payloads may take. The rest is the
    headroom of the indexes, the dedupe window, a lease's payload copies and the policy record, so that
    the learner's leases, acks and publishes never meet Redis' own out-of-memory refusal."""
    max_times_sampled: int | None = Field(1, ge=1, le=MAX_COUNT)
    """A group is removed once sampled this many times; None = never (replay until evicted or stale)."""
    max_staleness: int | None = Field(None, ge=0, le=MAX_COUNT)
    """Largest `consumer_version - policy_version` a sample may return, in policy versions (optimizer
    steps); older groups are dropped and counted. None = no staleness gate."""
    sampler: Sampler = "fifo"
    """How `sample` chooses among eligible groups: `fifo` (oldest insert first), `newest`, `uniform`,
    `staleness_weighted` (weight 1/(staleness+1)), `prioritized` (weight = (priority +
    priority_epsilon)^priority_alpha)."""
    priority_epsilon: float = Field(0.01, ge=0.0)
    """Added to every priority of the `prioritized` sampler so zero-advantage groups keep a chance."""
    priority_alpha: float = Field(1.0, ge=0.0, le=16.0)
    """The `prioritized` sampler's exponent (prioritized experience replay's alpha): a group is chosen
    with probability proportional to (priority + priority_epsilon)^alpha; 0 = uniform among the groups
    with a priority, 1 = proportional to the priority (the default, as before the exponent existed)."""
    min_size_to_sample: int = Field(1, ge=1, le=MAX_COUNT)
    """Reverb's MinSize: sampling waits until the buffer holds this many groups."""
    samples_per_insert: float | None = Field(None, gt=0.0, le=MAX_COUNT)
    """Reverb's SampleToInsertRatio: target groups sampled per group inserted. None = no ratio limiter."""
    error_buffer: float | None = Field(None, gt=0.0, le=MAX_COUNT)
    """Allowed drift from the ratio, in samples, either side of `samples_per_insert * min_size_to_sample`.
    Required with `samples_per_insert`; must be >= max(1, samples_per_insert)."""
    max_ahead: int | None = Field(None, ge=1, le=MAX_COUNT)
    """Producer pacing: `wait_for_room` holds a producer while the buffer holds at least this many groups
    a learner at the producer's version could still sample. None = never hold producers."""
    insert_timeout_s: float = Field(30.0, gt=0.0, le=MAX_WAIT_S)
    """How long an insert waits for the ratio limiter before raising `RateLimited`, in seconds."""
    backoff_initial_s: float = Field(0.005, gt=0.0, le=MAX_WAIT_S)
    """First wait between retries of a limited call, in seconds (doubles up to `backoff_max_s`)."""
    backoff_max_s: float = Field(0.25, gt=0.0, le=MAX_WAIT_S)
    """Longest wait between retries of a limited call, in seconds."""
    storage_timeout_s: float = Field(5.0, gt=0.0, le=MAX_WAIT_S)
    """Redis unreachable: how long calls retry (with backoff) before raising `StorageUnavailable`, s."""
    socket_timeout_s: float = Field(10.0, gt=0.0, le=MAX_WAIT_S)
    """Redis socket read/write and connect timeout, in seconds."""
    limits: CodecLimits = CodecLimits()
    """Validation limits for every group inserted and sampled."""
    dedupe_window: int | None = Field(100_000, ge=1, le=MAX_COUNT)
    """Dedupe window by count: the group ids of the last this many inserts are remembered (a stored group
    is always recognised). A duplicate arriving after its id left the window is stored again. None = no
    count bound (with `dedupe_window_s` None too: every id ever inserted is kept, the set grows forever)."""
    dedupe_window_s: float | None = Field(None, gt=0.0, le=MAX_AGE_S)
    """Dedupe window by age, in seconds (Redis clock): ids inserted longer ago are forgotten (same
    consequence as `dedupe_window`). None = no age bound."""
    dead_letter_max: int = Field(1_000, ge=1, le=MAX_COUNT)
    """Most records the dead-letter list keeps (newest first); older ones are trimmed. The counters
    `dropped:invalid:<field>` keep counting every group set aside."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.min_size_to_sample > self.max_size:
            raise ValueError(
                f"min_size_to_sample={self.min_size_to_sample} > max_size={self.max_size}: "
                "the buffer could never hold enough groups to sample (deadlock)"
            )
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(
                f"backoff_initial_s={self.backoff_initial_s} > backoff_max_s={self.backoff_max_s}"
            )
        if self.samples_per_insert is None:
            if self.error_buffer is not None:
                raise ValueError(f"error_buffer={self.error_buffer} is set but samples_per_insert is None")
            return self
        if self.error_buffer is None:
            raise ValueError(f"samples_per_insert={self.samples_per_insert} needs an error_buffer")
        if self.error_buffer < max(1.0, self.samples_per_insert):
            raise ValueError(
                f"error_buffer={self.error_buffer} < max(1, samples_per_insert={self.samples_per_insert}): "
                "a smaller buffer can block inserts and samples at the same time (deadlock, as in Reverb)"
            )
        if self.max_times_sampled is not None and self.samples_per_insert > self.max_times_sampled:
            raise ValueError(
                f"samples_per_insert={self.samples_per_insert} > max_times_sampled={self.max_times_sampled}:"
                " groups are removed before the ratio can be met, so inserts would block forever (deadlock)"
            )
        return self

    # --- presets (Reverb's Table.queue / uniform replay, plus the staleness-aware table)

    @classmethod
    def queue(cls, max_size: int = 10_000, **overrides: Any) -> BufferConfig:
        """FIFO, each group consumed once: on-policy-ish streaming from actors to the learner."""
        return cls(**{"max_size": max_size, "sampler": "fifo", "max_times_sampled": 1, **overrides})

    @classmethod
    def uniform_replay(cls, max_size: int = 10_000, **overrides: Any) -> BufferConfig:
        """Uniform replay: groups are reused until evicted by `max_size` (classic experience replay)."""
        return cls(**{"max_size": max_size, "sampler": "uniform", "max_times_sampled": None, **overrides})

    @classmethod
    def staleness_weighted(
        cls, max_size: int = 10_000, max_staleness: int = 4, **overrides: Any
    ) -> BufferConfig:
        """Fresh groups first (weight 1/(staleness+1)), hard gate at `max_staleness`, each used up to 4x."""
        defaults = {"sampler": "staleness_weighted", "max_times_sampled": 4}
        return cls(**{**defaults, "max_size": max_size, "max_staleness": max_staleness, **overrides})

    # --- the table-wide fields, shared through Redis (the learner's are the run's)

    def table_json(self) -> str:
        """The table-wide fields (all but LOCAL_FIELDS) as JSON: what the learner publishes."""
        return self.model_dump_json(exclude=set(LOCAL_FIELDS))

    def with_table(self, table_json: str | bytes) -> BufferConfig:
        """This config with the table-wide fields of `table_json` (the local ones kept), validated whole;
        invalid JSON or fields raise pydantic's `ValidationError`."""
        table = type(self).model_validate_json(table_json).model_dump(exclude=set(LOCAL_FIELDS))
        return type(self).model_validate({**self.model_dump(), **table})

    # --- what the Lua scripts need

    def limiter_bounds(self) -> tuple[float, float]:
        """(min_diff, max_diff) of Reverb's SampleToInsertRatio; (-inf, inf) when there is no ratio."""
        if self.samples_per_insert is None or self.error_buffer is None:
            return float("-inf"), float("inf")
        offset = self.samples_per_insert * self.min_size_to_sample
        return offset - self.error_buffer, offset + self.error_buffer
