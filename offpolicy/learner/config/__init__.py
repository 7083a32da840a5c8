"""The learner's configuration as data: one frozen model per concern, loaded from YAML + `OFFPOLICY_` env.

Fields marked `frozen_while_running` (in their JSON schema) cannot change while the loop runs: the REST API
answers 409 naming them; `frozen_field_changes(old, new)` lists the ones a new config would change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator

from offpolicy.buffer.config import BufferConfig
from offpolicy.config.base import (
    FROZEN,
    MAX_ATTEMPTS,
    MAX_BATCH,
    MAX_BYTES,
    MAX_COUNT,
    MAX_KEEP,
    MAX_SEQ_TOKENS,
    MAX_WAIT_S,
    ConfigModel,
    PathStr,
    RunId,
)
from offpolicy.config.loader import env_overrides as env_overrides
from offpolicy.config.loader import load_layered
from offpolicy.config.loader import merge as merge
from offpolicy.config.vision import ImagePixels, VisionTraining
from offpolicy.learner.config.control import ControlConfig
from offpolicy.learner.config.lora import LoraConfig
from offpolicy.learner.config.models import (
    CriticConfig,
    FsdpConfig,
    OptimizerConfig,
    ReferenceConfig,
    TeacherConfig,
)
from offpolicy.learner.config.moe import MoeConfig
from offpolicy.learner.config.priorities import PrioritiesConfig
from offpolicy.learner.config.publish import CheckpointConfig, PublishConfig
from offpolicy.learner.config.screening import ScreeningConfig
from offpolicy.learner.config.tracking import TrackingConfig
from offpolicy.learner.correction.config import RolloutCorrectionConfig

PrecisionName = Literal["bf16_mixed", "fp32", "bf16_pure"]
"""Master weights, optimizer state and compute dtype by one name (learner/model/precision.py)."""

WRITABLE = {"writable_path": True}

AttnImplementation = Literal[
    "auto", "torch_varlen", "sdpa_varlen", "sdpa", "flash_attention_2", "flash_attention_3",
    "flex_attention", "eager",
]  # fmt: skip
TokenBudget = Annotated[int, Field(ge=1, le=MAX_SEQ_TOKENS)] | Literal["auto"]
"""Tokens per micro-batch, or `auto`: the largest the memory plan admits (learner/plan/memory.py)."""
LogprobHead = Literal["fused", "chunked"]
"""How the LM head gives the sampled tokens' log-probs (learner/model/head.py)."""
AdvEstimator = Literal["grpo", "rloo", "reinforce", "gae"]
LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"
]
KlLossType = Literal[
    "kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3",
    "kl+", "abs+", "mse+", "low_var_kl+", "k1+", "k2+", "k3+",
]  # fmt: skip
"""verl 0.9.1's `kl_penalty` names (learner/rl/losses.py `kl_penalty`): k1 = kl, k2 = mse, k3 = low_var_kl;
a trailing `+` keeps the value and takes k2's gradient (straight-through). verl's `full` raises
NotImplementedError there and is refused here."""


class LearnerConfig(ConfigModel):
    """Everything the learner loop reads; applied at step boundaries (DESIGN.md "Learner")."""

    # --- model and device
    model_path: PathStr = Field(json_schema_extra=FROZEN)
    """Hugging Face causal LM: a local folder or a hub id."""
    device: str | None = Field(None, max_length=64, json_schema_extra=FROZEN)
    """torch device, e.g. `cuda:0` or `cpu`; None = CUDA when available, else CPU."""
    precision: PrecisionName | None = Field(None, json_schema_extra=FROZEN)
    """`bf16_mixed` (fp32 master weights and AdamW state, bf16 autocast compute), `fp32`, or `bf16_pure`
    (bf16 weights and optimizer state: loses updates below bf16's rounding step, e.g. most of lr 1e-6;
    opt-in only). None = `bf16_mixed` on CUDA, `fp32` on CPU (learner/model/precision.py)."""
    gradient_checkpointing: bool | Literal["auto"] | None = Field(None, json_schema_extra=FROZEN)
    """Recompute decoder layers' activations in the backward pass (less memory; each checkpointed layer
    costs its forward again, ~1/3 more of its compute). `true`: `checkpoint_layers` layers (all when unset).
    `auto` = none when the memory plan fits the device without it, else the fewest layers that let the
    micro-batch fit (learner/plan/auto.py); on CPU (no device limit unless `memory_limit_gib`) none.
    None = `auto` on CUDA, off on CPU."""
    checkpoint_layers: int | None = Field(None, ge=1, json_schema_extra=FROZEN, le=MAX_KEEP)
    """How many decoder layers are checkpointed when checkpointing is on, spread evenly through the stack
    (torchtitan's per-layer selective checkpointing); None = all under `true`, the plan's choice under
    `auto`. Above the model's layer count: all."""
    attn_implementation: AttnImplementation = Field("auto", json_schema_extra=FROZEN)
    """The attention kernel of the policy and critic (learner/model/attention.py). `auto` = on CUDA
    `flash_attention_3` or `flash_attention_2` where that package is installed, else `torch_varlen` where
    this torch has `torch.nn.attention.varlen`, else `sdpa_varlen`; on CPU `sdpa_varlen`. `torch_varlen`
    runs PyTorch's variable-length FlashAttention on the whole packed row in one call; `sdpa_varlen` runs
    PyTorch's SDPA causally on each packed sequence (no mask, no compute across sequences); both compute
    sliding windows and refuse attention soft-capping by name. `sdpa`, `eager` and `flex_attention` run on
    the block-diagonal causal mask transformers builds for packed rows."""
    compile_layers: bool | Literal["auto"] = Field("auto", json_schema_extra=FROZEN)
    """`torch.compile` each decoder layer's forward (dynamic shapes: packed micro-batches of any length
    reuse one graph; FSDP2's hooks and activation checkpointing stay outside it; learner/model/compile.py).
    `auto`: on where it was measured to pay, a learner of one process on CUDA without LoRA (the 4B's step
    1.6x faster on an H200, for a first step of ~27 s); off on CPU (Inductor's C++ build takes minutes),
    under FSDP on several ranks and under LoRA, where `true` turns it on (not yet measured there)."""
    memory_limit_gib: float | None = Field(None, gt=0.0, json_schema_extra=FROZEN, le=MAX_BYTES / 2**30)
    """The memory one rank may plan for, GiB (learner/plan/memory.py: the learner refuses to start with a plan
    above it, naming the knobs). None = 90 % of the CUDA device's memory; no check on CPU."""
    fsdp: FsdpConfig = FsdpConfig()
    """Sharding across the ranks of a multi-GPU learner (learner/distributed/fsdp.py)."""
    logprob_chunk_tokens: int = Field(4096, ge=1, le=MAX_SEQ_TOKENS)
    """Tokens of a micro-batch whose fp32 logits exist at once when computing log-probs (the LM head runs
    on chunks of response positions; `learner/model/policy.py` `token_logprobs`)."""
    logprob_head: LogprobHead = "fused"
    """`fused`: each chunk's logits are made once by the LM head and read once by one fused log-softmax,
    gather (and entropy) pass, recomputed from the hidden states in the backward pass (compiled with
    torch.compile on CUDA); `chunked`: the earlier head (fp32 copies of each chunk's logits, the whole
    chunk recomputed under activation checkpointing), kept for comparison (learner/model/head.py)."""
    seed: int = Field(0, ge=0, lt=2**63, json_schema_extra=FROZEN)
    """Seed of torch's and Python's generators at start (restored from the checkpoint on resume)."""
    torch_threads: int | None = Field(None, ge=1, json_schema_extra=FROZEN, le=MAX_BATCH)
    """Threads of torch's CPU intra-op pool (`torch.set_num_threads`, set once at start); None = torch's
    default (one per core). Set it when the learner shares a CPU machine with a vLLM CPU actor, whose
    worker pins a core of its own: oversubscribed cores slow both."""

    # --- the algorithm
    groups_per_step: int = Field(8, ge=1, le=MAX_BATCH)
    """Groups sampled from the buffer for one learner step."""
    ppo_epochs: int = Field(1, ge=1, le=MAX_ATTEMPTS)
    """Passes over each sampled batch."""
    mini_batch_groups: int | None = Field(None, ge=1, le=MAX_BATCH)
    """Groups per optimizer step; None = the whole batch (one optimizer step per epoch). Must divide
    `groups_per_step`. Policy version advances by `ppo_epochs * groups_per_step / mini_batch_groups`."""
    packing: bool = True
    """Micro-batches as packed rows: whole sequences (prompt + response) concatenated without padding,
    positions restarting at 0, attention confined to each sequence, at most `micro_batch_tokens` tokens per
    forward/backward. False = padded rows, `micro_batch_size` at a time (for comparison)."""
    micro_batch_tokens: TokenBudget = 16384
    """With `packing`: the most tokens (prompt + response) in one forward/backward, per rank. Sequences are
    bin-packed within each mini-batch (largest first onto the lightest micro-batch); every rank runs the
    same number of micro-batches, the k-th balanced across ranks. A sequence longer than this gets a
    micro-batch of its own (never an error). `auto` = the largest budget the memory plan admits on the
    device (learner/plan/memory.py `choose`; 16384 where there is no device limit, as on CPU)."""
    no_grad_micro_batch_tokens: TokenBudget | None = None
    """With `packing`: the most tokens in one pass without gradients (pi_old, the KL reference's
    log-probs, the critic's values), which keeps no activations. None = `micro_batch_tokens`; `auto` = the
    largest the memory plan admits for a forward alone (at most 262,144)."""
    micro_batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    """Without `packing`: completions (rows) per forward/backward; gradients accumulate over a mini-batch's
    micro-batches."""
    adv_estimator: AdvEstimator = "grpo"
    """`grpo` (group mean/std), `rloo` (leave-one-out), `reinforce` (batch baseline), `gae` (critic)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (False = Dr. GRPO)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount for `gae` (token steps)."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How the per-token loss matrix becomes a scalar (spec §5.4)."""
    clip_ratio_low: float = Field(0.2, ge=0.0, lt=1.0)
    """PPO clip: ratio lower bound 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(0.2, ge=0.0)
    """PPO clip: ratio upper bound 1 + clip_ratio_high (DAPO clip-higher when > clip_ratio_low)."""
    clip_ratio_c: float = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages; must be > 1."""
    grad_clip: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value; None = no clipping (the norm is still reported)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Policy optimizer and LR schedule."""
    critic: CriticConfig = CriticConfig()
    """Value model; used only with `adv_estimator: gae`."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Rollout correction (spec); a preset name (canonical or seed alias) is accepted in its place.
    The default computes the off-policy metrics only."""
    kl_loss_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL-to-reference loss added to the policy loss (verl's `use_kl_loss`:
    `policy_loss + kl_loss_coef * kl_loss`); 0 = off, no reference loaded. Switching it between 0 and > 0
    while running is refused (the reference cannot appear or vanish mid-run)."""
    kl_loss_type: KlLossType = "low_var_kl"
    """The per-token KL estimator of the KL loss against the reference (verl's `kl_loss_type`, default
    `low_var_kl` = k3), aggregated with `loss_agg_mode` over the response mask."""
    reference: ReferenceConfig = ReferenceConfig()
    """The reference policy of the KL loss (used only with `kl_loss_coef > 0`)."""
    teacher: TeacherConfig = TeacherConfig()
    """On-policy distillation from a frozen teacher (used only with `teacher.model_path` set)."""
    lora: LoraConfig | None = Field(None, json_schema_extra=FROZEN)
    """Train a LoRA adapter on the frozen base model instead of the full weights, and publish only the
    adapter (docs/lora.md); None = full weights."""
    image_pixels: ImagePixels = Field(ImagePixels(), json_schema_extra=FROZEN)
    """A vision-language policy's pixel budget per image (its image processor's `min_pixels` /
    `max_pixels`; None: the checkpoint's); the actors' `engine.image_pixels` must be the same."""
    vision: VisionTraining = Field(VisionTraining(), json_schema_extra=FROZEN)
    """A vision-language policy's tower: frozen by default (`vision.train: true` trains it too; not with
    `lora`, whose adapter covers the language model)."""
    moe: MoeConfig = MoeConfig()
    """A mixture-of-experts policy's router losses (load balancing, z-loss); off by default, refused above 0
    for a dense policy (docs/learner.md "MoE models")."""
    entropy_coeff: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus subtracted from the policy loss (`pg_loss - entropy_coeff * entropy`,
    the entropy of the policy's distribution at each trained token, at its temperature, aggregated with
    `loss_agg_mode`), reported as `actor/entropy`; 0 = off, the entropy not computed (it costs one more
    softmax-sized pass over each chunk of logits, forward and backward)."""

    # --- the buffer
    redis_url: str = Field("redis://localhost:6379/0", json_schema_extra=FROZEN)
    """Redis holding the replay buffer and the policy record."""
    run_id: RunId = Field("default", json_schema_extra=FROZEN)
    """Namespace of this run's keys in Redis (the buffer's hash tag)."""
    buffer: BufferConfig = BufferConfig()
    """Replay table: sampler, staleness gate, remover, rate limiter."""
    sample_timeout_s: float = Field(30.0, gt=0.0, le=MAX_WAIT_S)
    """How long one `sample` call waits for enough groups before the step is retried."""
    delivery: Literal["checkpoint", "step"] | None = Field(None, json_schema_extra=FROZEN)
    """When a trained group's lease is acknowledged (its use counted in the buffer; learner/delivery.py):
    `checkpoint` = once the checkpoint holding the update is durable (a kill -9 at any point loses no group
    and trains none twice in the resumed history; leased groups stay in Redis until then), `step` = right
    after the update (runs without checkpoints). None = `checkpoint` when periodic checkpoints are on
    (`checkpoint_dir` and `checkpoint_every` set), else `step`."""
    screening: ScreeningConfig = ScreeningConfig()
    """Dynamic sampling: groups that teach nothing dropped, truncated completions filtered or punished, the
    batch kept full by sampling more (learner/rl/dynamic_sampling.py); off by default."""
    control: ControlConfig = ControlConfig()
    """The staleness bound: `fixed` (`buffer.max_staleness` as given) or `auto` (set each step from the
    rollout correction's IS ESS and masked share and the learner's wait for data, within the limits given);
    the actor capacity the learner asks for (learner/control/)."""
    priorities: PrioritiesConfig = PrioritiesConfig()
    """Prioritized replay kept current: the priority the learner writes back with each ack, and the
    importance weights (`beta`) that undo the `prioritized` sampler's bias (learner/rl/priorities.py)."""
    lease_s: float = Field(600.0, ge=1.0, le=86400.0)
    """Seconds a lease lasts unless renewed; the learner renews its leases every `lease_s / 4` while it
    lives, so only a dead learner's leases expire back into the buffer (a restarted one releases them at
    once)."""
    prefetch: bool | None = None
    """Lease the next step's groups (the sample script, the payloads' transfer and decoding) in a background
    thread while this step trains, at the policy version that step will train at; a config change or a
    failed step in between gives them back and leases again (learner/intake.py). Under the `prioritized`
    sampler the next groups are drawn before this step's new priorities are written: one step behind, as
    Ape-X's learner prefetches. None = on with CUDA (the host is idle while the device trains), off on CPU
    (the step's own threads use the cores)."""

    # --- publishing, checkpoints, logs
    publish: PublishConfig = PublishConfig()
    """Weight publication for the actors."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Resumable checkpoints."""
    max_steps: int | None = Field(None, ge=1, le=MAX_COUNT)
    """`run` returns after this many learner steps; None = until stopped."""
    metrics_jsonl: PathStr | None = Field(None, json_schema_extra=WRITABLE)
    """Append each step's metrics as one JSON line to this file; None = don't. A change while running is
    accepted only when the file's folder exists or can be created and is writable."""
    tracking: TrackingConfig = TrackingConfig()
    """TensorBoard, Weights & Biases and MLflow (each optional), and the completions logged per version."""

    @field_validator("kl_loss_type", mode="before")
    @classmethod
    def _no_full_kl(cls, value: Any) -> Any:
        if value in ("full", "full+"):
            raise ValueError(
                f"kl_loss_type={value!r} is not implemented: verl 0.9.1's kl_penalty raises "
                "NotImplementedError for it; use kl (k1), abs, mse (k2) or low_var_kl (k3), "
                "optionally with '+'"
            )
        return value

    @field_validator("rollout_correction", mode="before")
    @classmethod
    def _preset_by_name(cls, value: Any) -> Any:
        return RolloutCorrectionConfig.from_preset(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Self:
        mb = self.mini_batch_groups
        if mb is not None and self.groups_per_step % mb != 0:
            raise ValueError(f"mini_batch_groups={mb} must divide groups_per_step={self.groups_per_step}")
        root = self.publish.weights_root
        if root is not None and not Path(os.path.abspath(self.weights_path)).is_relative_to(
            os.path.abspath(root)
        ):
            raise ValueError(
                f"publish.weights_dir={self.publish.weights_dir!r} is not under publish.weights_root="
                f"{root!r}: the policy record names folders relative to the root"
            )
        periodic = self.checkpoint.checkpoint_dir is not None and self.checkpoint.checkpoint_every is not None
        if self.delivery == "checkpoint" and not periodic:
            raise ValueError(
                "delivery='checkpoint' acknowledges leases at periodic checkpoints, but checkpoint_dir="
                f"{self.checkpoint.checkpoint_dir!r}, checkpoint_every={self.checkpoint.checkpoint_every!r}: "
                "set both, or use delivery='step'"
            )
        if self.vision.train and self.lora is not None:
            raise ValueError(
                "vision.train with lora: the adapter covers the language model and the tower stays frozen; "
                "set vision.train: false, or train full weights (lora: null)"
            )
        if self.lora is not None and self.publish.transport != "files":
            raise ValueError(
                "lora: an adapter is published as files (megabytes, loaded by the actors' LoRA support), "
                f"but publish.transport={self.publish.transport!r}: set publish.transport: files"
            )
        distilling = self.teacher.model_path is not None and self.teacher.task_reward_weight == 0
        if distilling and self.screening.drop_zero_variance:
            raise ValueError(
                "screening.drop_zero_variance drops groups by their task rewards, but with a teacher and "
                "teacher.task_reward_weight=0 every group teaches through the distillation term: turn "
                "drop_zero_variance off, or give the task reward a weight"
            )
        return self

    @property
    def delivery_mode(self) -> Literal["checkpoint", "step"]:
        """`delivery` with None resolved."""
        if self.delivery is not None:
            return self.delivery
        periodic = self.checkpoint.checkpoint_dir is not None and self.checkpoint.checkpoint_every is not None
        return "checkpoint" if periodic else "step"

    @property
    def weights_path(self) -> Path:
        """`publish.weights_dir` with `{run_id}` filled in."""
        return Path(self.publish.weights_dir.replace("{run_id}", self.run_id))

    @property
    def checkpoint_path(self) -> Path | None:
        """`checkpoint.checkpoint_dir` with `{run_id}` filled in; None = checkpoints disabled."""
        cdir = self.checkpoint.checkpoint_dir
        return None if cdir is None else Path(cdir.replace("{run_id}", self.run_id))

    @property
    def adapter_reference(self) -> bool:
        """The KL loss's reference is the policy's own base model, its LoRA adapter disabled (`lora` set,
        `reference.model_path` None): no second copy of the weights is loaded, planned or offloaded."""
        return self.lora is not None and self.reference.model_path is None

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps (= policy versions) per learner step."""
        return self.ppo_epochs * self.groups_per_step // (self.mini_batch_groups or self.groups_per_step)


# --- loading


def marked_field_paths(marker: str, model: type[BaseModel] = LearnerConfig, prefix: str = "") -> list[str]:
    """Dotted paths of every field whose JSON schema extra sets `marker`, nested models included."""
    paths = []
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get(marker):
            paths.append(prefix + name)
        elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            paths.extend(marked_field_paths(marker, info.annotation, f"{prefix}{name}."))
    return paths


def frozen_field_paths(model: type[BaseModel] = LearnerConfig, prefix: str = "") -> list[str]:
    """Dotted paths of every field marked `frozen_while_running`, nested models included."""
    return marked_field_paths("frozen_while_running", model, prefix)


def writable_path_fields(model: type[BaseModel] = LearnerConfig) -> list[str]:
    """Dotted paths of the file paths the learner writes that may change while it runs (`writable_path`):
    the control plane checks that their folder can be created and written before it accepts a change."""
    return marked_field_paths("writable_path", model)


def frozen_field_changes(old: LearnerConfig, new: LearnerConfig) -> list[str]:
    """The frozen-while-running fields whose value differs between `old` and `new` (dotted paths)."""
    a, b = old.model_dump(), new.model_dump()
    changed = []
    for path in frozen_field_paths():
        va, vb = a, b
        for part in path.split("."):
            va, vb = va[part], vb[part]
        if va != vb:
            changed.append(path)
    if (old.adv_estimator == "gae") != (new.adv_estimator == "gae"):
        changed.append("adv_estimator")  # a critic cannot appear or vanish mid-run
    if (old.kl_loss_coef > 0) != (new.kl_loss_coef > 0):
        changed.append("kl_loss_coef")  # nor can the reference model
    return changed


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> LearnerConfig:
    """Build a `LearnerConfig` from a YAML file, then `OFFPOLICY_*` variables of `environ`, then kwargs.

    Only the mapping passed as `environ` is read (pass `os.environ` explicitly from a CLI or app factory).
    Only keys under the learner's own fields are taken from the environment, so unrelated `OFFPOLICY_*`
    variables of other components (e.g. `OFFPOLICY_API_TOKEN`) are ignored
    (`offpolicy.config.loader.load_layered`).
    """
    return load_layered(LearnerConfig, path, environ, overrides)


def load_config_from_process_env(path: str | Path | None = None) -> LearnerConfig:
    """`load_config(path, os.environ)`: for command-line entry points (read at call time, not import)."""
    return load_config(path, os.environ)
