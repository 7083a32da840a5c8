"""Request and response models of the learner's control plane (`/v1/...`), as OpenAPI documents them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.correction.config import RolloutCorrectionConfig

ConfigSource = Literal["initial", "put", "patch", "resume"]


class FieldChange(BaseModel):
    """One changed field of a config version: its value before and after (as JSON)."""

    field: str
    """Dotted path, e.g. `optimizer.lr`."""
    old: Any
    """The previous config version's value (null where it had none)."""
    new: Any
    """This version's value (null where it has none)."""


class ConfigEntry(BaseModel):
    """One config the learner ran (or will run from its next step boundary) and when it took effect."""

    config_version: int = Field(ge=0)
    """0 for the config the service started with (its file), 1 for the config a resumed learner runs (the
    checkpoint's or the file's: `checkpoint.resume_config`), +1 for every accepted PUT or PATCH."""
    source: ConfigSource
    """What produced it: the start-up file, the resumed checkpoint, a PUT, a PATCH."""
    submitted_at: float
    """Unix seconds when the service accepted it."""
    applied_at: float | None
    """Unix seconds of the step boundary where the loop switched to it; null while still pending."""
    applied_at_step: int | None
    """Learner steps completed at that boundary, as the learner reports it (`on_config_applied`): step
    `applied_at_step + 1` is the first that runs with this config; null while pending."""
    changed_fields: list[str]
    """Dotted paths of the fields that differ from the previous config version (a `resume` entry: the
    fields where the start-up file and the resumed checkpoint's config disagree)."""
    config: LearnerConfig
    detail: str | None = None
    """A `resume` entry: which checkpointed config version was reapplied and which rule decided
    (`checkpoint.resume_config`)."""
    changes: list[FieldChange] = Field(default_factory=list)
    """Each of `changed_fields` with its old value (the previous version's) and its new one, as
    `GET /v1/config/history` answers it (the Redis password masked in both)."""


class StalenessChange(BaseModel):
    """One change of the staleness bound by the learner's controller (`control.mode: auto`)."""

    step: int
    """Learner steps completed at the boundary where it took effect."""
    at: float
    """Unix seconds."""
    old: int | None
    """The bound before (null: `buffer.max_staleness` as given)."""
    new: int | None
    """The bound after (null: back to `buffer.max_staleness` as given)."""
    reason: str
    """`start`, `ess_below_floor`, `masked_above_ceiling`, `learner_waiting`, `limits`,
    `mode_fixed` or `missing_metrics`."""
    detail: str
    """The figures it judged (ESS, masked share, wait share over its window) or what changed."""


class ConfigHistory(BaseModel):
    """Every config version, oldest first; and the controller's changes of the staleness bound."""

    entries: list[ConfigEntry]
    control: list[StalenessChange] = []
    """The staleness controller's changes (the last 1,000), oldest first; empty under `control.mode:
    fixed`."""


class ConfigChange(BaseModel):
    """Answer to a PUT / PATCH: the version the change got and whether the loop runs it yet."""

    config_version: int
    status: Literal["pending", "applied"]
    """`pending` until the next step boundary (or `applied` at once while the loop is paused or idle)."""
    changed_fields: list[str]
    config: LearnerConfig


class ConfigValidation(BaseModel):
    """Answer to `POST /v1/config/validate`: the body is valid and allowed; nothing was applied."""

    valid: Literal[True] = True
    changed_fields: list[str]
    """Fields the change would modify relative to the newest accepted config."""
    config: LearnerConfig
    """The config the change would produce."""


class ConfigPatch(BaseModel):
    """A merge patch: nested objects merge into the current config, other values replace; a string for
    `rollout_correction` selects a preset by name."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": True})


class Preset(BaseModel):
    """A rollout-correction preset with the fields of its default configuration."""

    name: str
    """Canonical name (verl 0.9.1)."""
    aliases: list[str]
    """Seed-era names that resolve to it (some add a veto or IS metrics; GET the alias to see its fields)."""
    fields: RolloutCorrectionConfig


class PresetList(BaseModel):
    presets: list[Preset]


class LearnerStatus(BaseModel):
    """What the learner is doing: state, version, throughput, buffer, last step's key metrics."""

    state: str
    """`starting`, `running`, `waiting_for_data`, `waiting_for_redis` (retrying until Redis answers;
    `/readyz` 503), `waiting_for_checkpoint` (checkpoints failing and `checkpoint.max_undurable_steps`
    reached: no new groups until one lands; `/readyz` 503), `paused`, `finished`, `stopped` or `failed`
    (`/healthz` 503, the process exits)."""
    policy_version: int
    """Optimizer steps taken so far (= the version the actors load)."""
    step: int
    """Learner steps taken (each step samples one batch)."""
    versions_per_step: int | None = None
    """Policy versions (optimizer steps) a learner step takes: `ppo_epochs x groups_per_step /
    mini_batch_groups` of the running config (`buffer.max_staleness` counts versions, `publish_every` learner
    steps: the start log's `units:` line); null before it starts."""
    config_version: int
    """Version of the config the loop is running now."""
    pending_config_version: int | None
    """A newer accepted config that waits for the next step boundary; null when none."""
    world_size: int = 1
    """Processes (GPUs) the learner trains on (`offpolicy learner --nproc-per-node N`); rank 0 answers."""
    tokens_per_s: float | None
    """Trained response tokens per second over the last step; null before the first step."""
    buffer: dict[str, Any]
    """Buffer statistics (size, inserts, samples, drops by reason, ...)."""
    last_step: dict[str, float | None]
    """Key metrics of the last step (reward, loss, staleness, IS ESS, KL, ...); null where a value was NaN
    or infinite (a skipped update's gradient norm, say)."""
    memory_plan: dict[str, float] | None = None
    """The learner's memory estimate per rank in GiB, by part (weights, gradients, optimizer,
    compute_copies, activations, lm_head_chunk, host_offloaded, reference, layer_in_flight, teacher, total);
    null before it starts."""
    settings: dict[str, int | bool] | None = None
    """What the memory plan chose at start (learner/plan/auto.py): `gradient_checkpointing`,
    `checkpointed_layers` of `decoder_layers`, `micro_batch_tokens`, `no_grad_micro_batch_tokens`,
    `compile_layers` (`auto` resolved); null before it starts."""
    grad_sync: str | None = None
    """When the ranks reduce gradients, as resolved from `fsdp.grad_sync`: `mini_batch` (once per optimizer
    step) or `micro_batch` (each micro-batch); null before it starts."""
    host_memory_plan: dict[str, float] | None = None
    """The learner's host memory plan in GiB (rank 0's parts: process, startup, checkpoint_stager,
    publish_snapshot, published_sets, cpu_offload, reference, teacher, delta_base, total; and node_total,
    its node's ranks together, which the learner refused to start above the container's limit); null
    before it starts."""
    start_way: str | None = None
    """How the learner read its policy weights at start: `slices` (lean start, each rank its own),
    `broadcast` (lean start, rank 0 read the whole checkpoint), `whole` (one process) or `whole, sharded`;
    null before it starts."""
    writes_failing: dict[str, dict[str, Any]] = {}
    """The background writes failing now with an `OSError` (a full disk, an I/O error), by kind
    (`weights`, `checkpoint`): `path`, `reason` (errno name), `error`, `version`, `bytes_needed`, `since`
    (Unix seconds), `failures`, `retry_in_s`. Retried with backoff while training goes on; empty when none."""
    transfer: dict[str, Any] | None = None
    """`publish.transport: vllm`: the last send's `last_version`, `ok`, `error` and `group_size`;
    `unwinding` while a send or a group's teardown that outlived its bound still ends in the background
    (sends fail at once meanwhile, the actors go on with file generations); `stuck`, the sends and
    teardowns that outlived their bound (`offpolicy_learner_transfer_stuck_total`, the
    `OffpolicyTransferStuck` alert). Null with `transport: files`."""
    intake_stopped: str | None = None
    """Why the learner takes no new groups (state `waiting_for_checkpoint`); null when it takes them."""
    control: dict[str, Any] | None = None
    """The staleness bound and the actor capacity (`control`, learner/control/): `mode` (`fixed` or
    `auto`), `state` (`fixed`, `auto` or `fallback`: no IS or mask metrics to judge by), `staleness_bound`
    in force, `given_max_staleness` (the config's), `judged` (the last window's `ess`, `masked`,
    `wait_share`, `demand_gps`, `supply_gps`), `actor_capacity_ratio`, `changes_total` and the last 20
    `changes` (step, at, old, new, reason, detail)."""
    undurable_steps: int = 0
    """Learner steps not covered by a durable checkpoint (capped by `checkpoint.max_undurable_steps`)."""
    groups_dropped: dict[str, int] = {}
    """Groups dynamic sampling did not train since start (`screening`), by reason (`zero_variance`,
    `all_truncated`); acknowledged like trained ones. Empty when none was dropped."""
    error: str | None = None
    """Why the loop stopped, when it failed."""


class CheckpointResult(BaseModel):
    """Where the on-demand checkpoint was written."""

    path: str
    policy_version: int


class DeadLetter(BaseModel):
    """A group set aside because it could not be decoded or trained (`ReplayBuffer.dead_letter`)."""

    group_id: str
    """The group's id (its payload is deleted; the dedupe window still refuses it)."""
    reason: str
    """Why, e.g. `decode: ...` for a payload that failed to decode, or the learner's message."""
    field: str
    """The offending field, e.g. `payload` or `trajectories[2].response_ids`."""
    time_ms: int
    """When it was set aside, Unix milliseconds (Redis clock)."""
    consumer: str
    """The consumer whose lease it was; empty when it was set aside by group id (a consuming sample)."""
    lease_id: str
    """The lease it was set aside under; empty likewise."""


class DeadLetterList(BaseModel):
    """The newest dead letters, newest first (the list keeps at most `buffer.dead_letter_max`)."""

    entries: list[DeadLetter]


class GroupsIngest(BaseModel):
    """Groups generated elsewhere, as JSON (buffer/json_records.py has the layout)."""

    groups: list[dict[str, Any]] = Field(min_length=1, max_length=1024)
    """The groups; each is validated on its own (a bad one is rejected by field, the rest stored)."""


class IngestResult(BaseModel):
    """What the buffer did with each posted group."""

    inserted: list[str]
    """group_ids stored."""
    duplicates: list[str]
    """group_ids already seen (nothing stored again)."""
    rejected: dict[str, str]
    """group_id (or `#<index>` without one) -> the failing field of each group refused (counted in
    `offpolicy_buffer_rejected_total` when the buffer refused it)."""
