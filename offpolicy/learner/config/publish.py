"""The learner's publish and checkpoint settings (`publish`, `checkpoint` of learner/config.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from offpolicy.config.base import FROZEN, MAX_COUNT, MAX_KEEP, ConfigModel, PathStr
from offpolicy.weights.config import TransferConfig

STREAM_DEPTH = 2
"""N ranks: buckets of a version's gather queued between rank 0's gather thread and its writer
(persist/background_gather.py; counted by the host plan, learner/plan/host.py)."""


class PublishConfig(ConfigModel):
    """Where and how often the learner publishes weights for the actors."""

    weights_dir: PathStr = Field("runs/{run_id}/weights", json_schema_extra=FROZEN)
    """Folder holding `v<version>/` (safetensors + manifest + config + tokenizer), shared with the actors;
    `{run_id}` is replaced by the run's id (`LearnerConfig.weights_path`), so runs never share a folder."""
    publish_every: int = Field(1, ge=1, le=MAX_COUNT)
    """Publish after every this many learner steps."""
    keep_versions: int = Field(3, ge=1, le=MAX_KEEP)
    """How many published versions stay on disk; older folders are deleted."""
    weights_root: PathStr | None = Field(None, json_schema_extra=FROZEN)
    """Where the shared weights volume is mounted on the learner; `weights_dir` must lie under it, and the
    policy record names each version's folder relative to it (`run-a/weights/v12`), so actors may mount
    the volume elsewhere (their `reload.weights_root`). None = the record holds the folder's absolute
    path, and every actor must see the volume at the learner's path."""
    transport: Literal["files", "vllm"] = "files"
    """How a published version reaches the actors. `files`: every version is written as a folder (the
    actors load it). `vllm`: every version is sent through vLLM's weight-transfer engine (`transfer`) to
    the actors in the group, and a file generation is still written every `persist_every` versions and at
    each checkpoint (what starting, restarted and failed actors load). docs/actor.md "Transports"."""
    persist_every: int = Field(10, ge=1, le=MAX_COUNT)
    """`transport: vllm`: write a file generation every this many publishes (and at checkpoints)."""
    transfer: TransferConfig = TransferConfig()
    """The transfer group's settings (`transport: vllm`)."""
    delta: Literal["off", "on", "auto"] = Field("off", json_schema_extra=FROZEN)
    """Write a version as the values that changed since the previous published one (weights/delta.py):
    at RL learning rates ~1 % of bf16 values change per version, so a delta version is a few percent of
    a full one on the shared volume and in each actor's read. `on`: every version but each
    `full_every`-th and any whose delta would be larger than a full version; `auto`: also whole when the
    delta passes `delta_share` of a full version. The writing rank keeps the last published version in
    host memory (counted by the host plan); actors apply the chain on a local copy
    (`reload.delta_dir`). With `transport: vllm` on the `gloo` backend the rounds sent through the engine
    are deltas too (weights/engines/delta_rounds.py: each side keeps the group's last round); on `nccl`
    they go whole. A LoRA learner's adapter is always published whole. docs/actor.md "Delta versions"."""
    full_every: int = Field(10, ge=1, le=MAX_COUNT, json_schema_extra=FROZEN)
    """`delta`: every this many published versions one is written whole (the chain an actor applies is
    at most `full_every - 1` deltas long); 1 = every version whole."""
    delta_share: float = Field(0.25, gt=0.0, le=1.0, json_schema_extra=FROZEN)
    """`delta: auto`: a version whose delta passes this share of a full version's bytes is written whole."""
    gather_bucket_mb: int = Field(256, ge=1, le=65536, json_schema_extra=FROZEN)
    """N ranks: a publish gathers the full weights to rank 0 in buckets of about this many MiB (in the
    publish dtype; a larger tensor is a bucket of its own): the device and pinned host memory the gather
    needs on rank 0, one bucket in flight; every other rank only sends its shards."""


class CheckpointConfig(ConfigModel):
    """Where and how often the learner writes resumable checkpoints."""

    checkpoint_dir: PathStr | None = Field("runs/{run_id}/checkpoints", json_schema_extra=FROZEN)
    """Folder of `ckpt-<version>/` checkpoints; the newest is resumed on start, and one written for another
    run or model is refused. `{run_id}` is replaced by the run's id. None = no checkpoints."""
    checkpoint_every: int | None = Field(10, ge=1, le=MAX_COUNT)
    """Checkpoint after every this many learner steps; None = only on demand (`POST /v1/checkpoints`)."""
    keep_checkpoints: int = Field(2, ge=1, le=MAX_KEEP)
    """How many checkpoints stay on disk."""
    max_undurable_steps: int | None = Field(None, ge=1, le=MAX_COUNT)
    """Durability bound while checkpoints fail (a full or broken checkpoint volume): at most this many
    learner steps not covered by a durable checkpoint (a crash would train their groups again; their leases
    stay unacknowledged). At the cap the learner stops taking new groups (state `waiting_for_checkpoint`,
    `/readyz` 503, the reason in `/v1/status`) and resumes when a checkpoint lands. None = 3 x
    `checkpoint_every` (no cap with only on-demand checkpoints). Must exceed `checkpoint_every`."""
    async_staging: bool = Field(True, json_schema_extra=FROZEN)
    """N ranks: copy each rank's shards to host memory on a background thread (pinned on CUDA, the buffers
    kept between checkpoints: host memory of about the shards' size stays taken), waited for only before
    the next optimizer step. False = copy at the step boundary into pageable memory, on the critical path."""
    resume_config: Literal["checkpoint", "file"] = "checkpoint"
    """Which config a resumed learner runs where the file and the newest checkpoint disagree: `checkpoint`
    = the run goes on as it was (the changes applied through the API survive a restart; the fields frozen
    while running still come from the file), `file` = the file wins (an edit before the restart takes
    effect). Always read from the file; the disagreeing fields are logged and shown in the config history's
    `resume` entry (learner/config/resume.py)."""

    @model_validator(mode="after")
    def _cap_above_interval(self) -> CheckpointConfig:
        every, cap = self.checkpoint_every, self.max_undurable_steps
        if cap is not None and every is not None and cap <= every:
            raise ValueError(
                f"checkpoint.max_undurable_steps ({cap}) must exceed checkpoint_every ({every}): "
                "the learner would stop before its next checkpoint is due"
            )
        return self

    @property
    def undurable_cap(self) -> int | None:
        """`max_undurable_steps` as it applies (None = no cap)."""
        if self.max_undurable_steps is not None:
            return self.max_undurable_steps
        return 3 * self.checkpoint_every if self.checkpoint_every else None
