"""The learner's model-side sections (of learner/config): the policy's optimizer, the GAE critic, how N
ranks shard (`fsdp`), the KL loss's frozen reference and on-policy distillation's teacher."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from offpolicy.config.base import FROZEN, MAX_BATCH, MAX_COUNT, ConfigModel, PathStr


class OptimizerConfig(ConfigModel):
    """AdamW with linear warm-up, then constant, linear or cosine decay (per optimizer step)."""

    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate, reached after `warmup_steps` optimizer steps."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay (AdamW)."""
    warmup_steps: int = Field(0, ge=0, le=MAX_COUNT)
    """Linear warm-up from 0 to `lr` over this many optimizer steps; 0 = start at `lr`."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up; `linear` and `cosine` reach `min_lr_ratio * lr` at `decay_steps`."""
    decay_steps: int | None = Field(None, ge=1, le=MAX_COUNT)
    """Optimizer step at which the decay ends (then the LR stays at its minimum). Required unless constant."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Final LR as a fraction of `lr` for `linear` / `cosine`."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.decay != "constant" and self.decay_steps is None:
            raise ValueError(f"decay={self.decay!r} needs decay_steps (got None)")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps={self.decay_steps} must be > warmup_steps={self.warmup_steps}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must lie in [0, 1)")
        return self


class CriticConfig(ConfigModel):
    """The value model for `adv_estimator: gae`: the policy's backbone architecture plus a scalar head."""

    model_path: PathStr | None = Field(None, json_schema_extra=FROZEN)
    """Where the critic's backbone comes from; None = the policy's `model_path`."""
    lr: float = Field(1e-5, gt=0.0)
    """Critic AdamW learning rate (constant)."""
    cliprange_value: float = Field(0.5, gt=0.0)
    """PPO value clipping: new values stay within this distance of the values at sampling time."""
    loss_coef: float = Field(0.5, gt=0.0)
    """Weight of the value loss (the critic has its own optimizer; this scales its gradient)."""


class FsdpConfig(ConfigModel):
    """How a learner on N ranks (`offpolicy learner --nproc-per-node N`) shards; ignored on one process."""

    cpu_offload: bool = Field(False, json_schema_extra=FROZEN)
    """FSDP2's `CPUOffloadPolicy`: sharded parameters, gradients and AdamW state live in host memory and
    the optimizer steps on the CPU (fits larger models, slower steps)."""
    replicate: int = Field(1, ge=1, json_schema_extra=FROZEN, le=MAX_BATCH)
    """Hybrid sharding (HSDP): the ranks form this many replica groups of consecutive ranks; parameters,
    gradients and AdamW state are sharded within a group and replicated across groups. Set it to the
    number of nodes when the network between nodes is much slower than within one (each micro-batch's
    all-gathers and reduce-scatters then stay inside a node; only the gradient all-reduce crosses) and
    a node's GPUs hold the model's shards. 1 = one flat mesh over every rank (the least memory per rank).
    Must divide the world size."""
    expert_parallel: int = Field(1, ge=1, json_schema_extra=FROZEN, le=MAX_BATCH)
    """Expert parallelism (EP) for a mixture-of-experts policy: each MoE layer's routed experts are cut
    over groups of this many consecutive ranks (each rank computes E / ep experts; tokens travel to their
    experts' ranks with all-to-all) and FSDP2 shards them over the N / ep groups; every other parameter
    is sharded over all ranks as before. Must divide the world size and the model's experts per layer;
    > 1 is refused for a dense model and with `replicate` > 1 or `cpu_offload`. 1 = no EP (FSDP2 gathers
    every expert of a layer for its compute). learner/distributed/expert_parallel.py."""
    grad_sync: Literal["auto", "mini_batch", "micro_batch"] = Field("auto", json_schema_extra=FROZEN)
    """When the ranks reduce gradients. `mini_batch`: once per optimizer step, after its last micro-batch
    (every rank holds the unsharded gradients between, in fp32: 4 bytes x parameters, the critic's
    included). `micro_batch`: each micro-batch's gradients are reduce-scattered at once (they stay
    sharded: the least memory, one reduction per micro-batch); with `replicate` > 1 the all-reduce across
    replica groups still runs once, at the last micro-batch. `auto`: `mini_batch` when the memory plan
    fits with the unsharded gradients and `cpu_offload` is off, else `micro_batch` (the choice is logged
    and in `/v1/status`)."""
    lean_start: bool = Field(True, json_schema_extra=FROZEN)
    """Build the models on the meta device and read each rank's shards alone from the safetensors files
    (host memory at start-up: about a rank's shards, not the whole fp32 model per rank); rank 0 reads
    and broadcasts when the checkpoint's tensors do not map one to one onto the model. False = every rank
    loads the whole model, then shards it (the old start, kept for comparison)."""


class ReferenceConfig(ConfigModel):
    """The frozen reference policy of the KL loss; loaded only when `kl_loss_coef > 0`."""

    model_path: PathStr | None = Field(None, json_schema_extra=FROZEN)
    """Where the reference's weights come from; None = the policy's `model_path` (its initial weights; a
    resumed run reloads them from there, never from a checkpoint)."""
    cpu_offload: bool = Field(False, json_schema_extra=FROZEN)
    """Keep the reference's weights in host memory: on N ranks FSDP2's `CPUOffloadPolicy` (like
    `fsdp.cpu_offload`), on one CUDA process each decoder layer is copied to the GPU for its forward alone
    (pinned host copies; embeddings, final norm and LM head stay on the GPU). Slower reference passes."""


class TeacherConfig(ConfigModel):
    """On-policy distillation: a frozen teacher scores each token the student sampled; the per-token reward
    is the negative reverse KL, -(log pi_old - log pi_teacher), mixed with the task's advantage
    (learner/rl/advantages.py `distill`; docs/learner.md "On-policy distillation"). Off while `model_path`
    is None. Built like the reference (learner/build.py `build_frozen`): sharded like the policy on N ranks,
    optionally in host memory."""

    model_path: PathStr | None = Field(None, json_schema_extra=FROZEN)
    """The teacher's weights (a folder or a hub id); its tokenizer must match the policy's (vocabulary and
    special tokens, checked at start). None = no teacher, no distillation."""
    cpu_offload: bool = Field(False, json_schema_extra=FROZEN)
    """Keep the teacher's weights in host memory, as `reference.cpu_offload` does for the reference."""
    reward_weight: float = Field(1.0, ge=0.0, json_schema_extra=FROZEN)
    """w_distill: the weight of the distillation term -(log pi_old - log pi_teacher) in each token's
    advantage."""
    task_reward_weight: float = Field(0.0, ge=0.0, json_schema_extra=FROZEN)
    """w_task: the weight of the task's advantage (the configured estimator's, from the groups' rewards);
    0 = pure distillation."""
