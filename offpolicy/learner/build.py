"""What a learner trains, built from its config: the policy (master weights in the precision's dtype),
its AdamW and LR schedule, and the critic with its own AdamW under GAE; on N ranks each sharded by FSDP2.

On N ranks the models are built on the meta device, sharded, and each rank then allocates and reads its
own shards (learner/distributed/lean.py: `fsdp.lean_start`), so no rank holds a whole fp32 copy in host
memory or on its GPU; with `lean_start: false` every rank loads the whole model into host memory and each
decoder layer moves to the GPU as it is sharded. `Trainables` is what
a step trains and a checkpoint saves; `set_hparams` applies a new config's optimizer and critic
hyper-parameters in place.
`build_reference` and `build_teacher` load the frozen reference policy of the KL loss and the teacher of
on-policy distillation, both by `build_frozen` (never checkpointed: reloaded from their `model_path` on
resume).

With `lora` the policy gets a LoRA adapter (learner/model/lora.py) right after it is built, before
checkpointing, compile and sharding: only the adapter is trainable, held by AdamW and published; the base
weights stay frozen in the compute dtype (bf16 under `bf16_mixed`), the adapter in the masters' (fp32).
A lean start reads the base under its checkpoint names
(`.base_layer.` dropped) and each rank copies its rows of the factors drawn from `seed` (the same whole
tensors on every rank). The KL loss's reference is then the policy itself with its adapter disabled
(`AdapterOff`) unless `reference.model_path` names another model.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from offpolicy.learner.config import LearnerConfig, OptimizerConfig
from offpolicy.learner.config.units import units
from offpolicy.learner.distributed import expert_parallel
from offpolicy.learner.distributed.fsdp import decoder_layers, fsdp_mesh, num_decoder_layers, shard
from offpolicy.learner.distributed.lean import fill, meta_model, unique_names
from offpolicy.learner.distributed.ranks import Ranks, local_device
from offpolicy.learner.model import attention, lora, moe
from offpolicy.learner.model.compile import compile_layers
from offpolicy.learner.model.critic import ValueModel
from offpolicy.learner.model.load import load_model, unique_state
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision, pick_device
from offpolicy.learner.model.recompute import checkpoint_layers
from offpolicy.learner.model.reference import AdapterOff, freeze, stream_layers
from offpolicy.learner.model.vision import is_vision_checkpoint
from offpolicy.learner.plan import host as host_plan
from offpolicy.learner.plan.auto import Settings, settings_for
from offpolicy.learner.plan.memory import (
    GIB,
    MemoryPlan,
    ModelShape,
    check,
    checkpointed,
    compiles,
    device_limit,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Trainables:
    """The stateful objects a checkpoint saves and restores (critic ones are None without GAE)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    policy: torch.nn.Module | None = None  # what the loop calls for log-probs (`model.LogProbs` of model)


def build_trainables(
    config: LearnerConfig,
    device: torch.device,
    precision: Precision,
    sharded: bool,
    checkpointing: bool | int | None = None,
    compiled: bool | None = None,
) -> tuple[Trainables, set[str], str]:
    """The policy, optimizer, scheduler and (GAE) critic of `config` on `device` (`sharded`: FSDP2), the
    names of the weights to publish (the state dict's, tied names dropped as `save_pretrained` does;
    taken before sharding, which hides the ties; under LoRA the adapter's alone), and how the policy's
    weights were read (`start_way`). `checkpointing`: the decoder layers checkpointed (a count, or
    True: `checkpoint_layers`, else all); None = `gradient_checkpointing` without a memory plan.
    `compiled`: whether the decoder layers are compiled; None = `compile_layers` resolved here
    (plan/memory.py `compiles`)."""
    if checkpointing is None:
        checkpointing = gradient_checkpointing(config, device)
    if compiled is None:
        compiled = compiles(config, device.type == "cuda", sharded)
    attn = attention.resolve(config.attn_implementation, device)
    # a vision-language checkpoint's tensors are named as its own layout, not transformers 5's modules:
    # every rank loads it whole before sharding (no lean start yet)
    lean = sharded and config.fsdp.lean_start and not is_vision_checkpoint(config.model_path)
    mesh = fsdp_mesh(config.fsdp.replicate, device) if sharded else None
    dtype, offload = precision.param_dtype, config.fsdp.cpu_offload
    # under LoRA the frozen base needs no masters: it is kept in the compute dtype (bf16 under bf16_mixed,
    # half the bytes), the adapter in the masters' (fp32); FSDP2 wants one dtype among trainable tensors only
    base = precision.compute_dtype or dtype if config.lora is not None else dtype
    if lean:
        model = meta_model(config.model_path, base, attn_implementation=attn)
    else:
        model = load_model(
            config.model_path, "cpu" if sharded else device, base, attn_implementation=attn,
            train_vision=config.vision.train,
        )  # fmt: skip
    router = moe.prepare(model, device, config.moe, config.model_path)  # MoE: grouped GEMMs, routers hooked
    if config.lora is not None:  # before the checkpointing, compile and FSDP wrappers see the layers
        lora.inject(model, config.lora, config.seed, masters=dtype)  # lean: factors on meta, drawn by `fill`
        if router is not None:
            moe.check_lora_targets(model)
    layers = num_decoder_layers(model)
    checkpointing = checkpointed(config, layers, checkpointing)  # True: `checkpoint_layers`, else all
    checkpoint_layers(model, decoder_layers(model, layers), checkpointing)
    if config.lora is not None:  # only the adapter is published (the actors hold the base model)
        publish_keys = set(lora.adapter_names(model))
    else:
        publish_keys = set(unique_names(model) if lean else unique_state(model))
    policy = LogProbs(model, config.logprob_head, router)  # what the loop calls for log-probs
    if compiled and router is not None and not sharded and base != torch.bfloat16:
        # under torch.compile transformers runs non-bf16 experts through its per-expert loop (grouped_mm
        # compiles for bf16 alone): an MoE policy with fp32 weights on one process stays eager
        log.info("compile_layers off: an MoE policy's %s experts run grouped_mm eagerly", base)
        compiled = False
    if compiled:
        compile_layers(decoder_layers(model, num_decoder_layers(model)))
    if sharded:
        shard(policy, num_decoder_layers(model), precision, offload, mesh, config.fsdp.expert_parallel)
    way = ("whole, sharded" if sharded else "whole") if not lean else ""
    if lean:
        way = fill(
            policy, "lm", model, config.model_path, base, _init_device(offload, device),
            lora_seed=None if config.lora is None else config.seed,
        )  # fmt: skip
    oc = config.optimizer
    # fused: one kernel over all parameters (5x faster than foreach for 160M fp32 parameters on CPU);
    # under LoRA the adapter's alone (the frozen base has no gradients and no moments)
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=oc.lr,
        betas=oc.betas,
        eps=oc.eps,
        weight_decay=oc.weight_decay,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(oc))
    critic, critic_optimizer = None, None
    if config.adv_estimator == "gae":
        path = config.critic.model_path or config.model_path
        backbone = None
        if lean:
            backbone = meta_model(path, dtype, causal=False, attn_implementation=attn)
            if checkpointing:
                backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        critic = ValueModel(
            path,
            "cpu" if sharded else device,
            dtype,
            gradient_checkpointing=checkpointing > 0,  # the critic's layers: all or none
            attn_implementation=attn,
            backbone=backbone,
        )
        if compiled:
            compile_layers(decoder_layers(critic.backbone, num_decoder_layers(critic.backbone)))
        if sharded:
            shard(critic, num_decoder_layers(critic.backbone), precision, offload, mesh)
        if lean:
            fill(
                critic, "backbone", critic.backbone, path, dtype, _init_device(offload, device), causal=False
            )
            critic.zero_head()
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.critic.lr, fused=True)
    return Trainables(model, optimizer, scheduler, critic, critic_optimizer, policy), publish_keys, way


def build_reference(
    config: LearnerConfig,
    device: torch.device,
    precision: Precision,
    sharded: bool,
    policy: torch.nn.Module | None = None,
) -> torch.nn.Module | None:
    """The frozen reference policy of the KL loss, or None when `kl_loss_coef` is 0: under LoRA without
    `reference.model_path` the `policy` (its `LogProbs`, the sharded root on N ranks) with its adapter
    disabled (`AdapterOff`: the base model, no second copy); else `build_frozen` of `reference.model_path`
    or the policy's `model_path`."""
    if config.kl_loss_coef == 0:
        return None
    if config.adapter_reference:
        if policy is None:
            raise ValueError("lora: the KL loss's reference is the policy, its adapter off: pass `policy`")
        return AdapterOff(policy)
    rc, path = config.reference, config.reference.model_path or config.model_path
    return build_frozen(config, path, rc.cpu_offload, device, precision, sharded)


def build_teacher(
    config: LearnerConfig, device: torch.device, precision: Precision, sharded: bool
) -> torch.nn.Module | None:
    """The frozen teacher of on-policy distillation, or None without `teacher.model_path`: `build_frozen`
    of its path (the trainer compares the tokenizers first: model/reference.py `check_teacher_tokenizer`)."""
    tc = config.teacher
    if tc.model_path is None:
        return None
    return build_frozen(config, tc.model_path, tc.cpu_offload, device, precision, sharded)


def build_frozen(
    config: LearnerConfig,
    path: str,
    cpu_offload: bool,
    device: torch.device,
    precision: Precision,
    sharded: bool,
) -> torch.nn.Module:
    """A frozen scorer (`LogProbs`: the KL reference or the distillation teacher) of the model at `path`.
    Its weights are in the compute dtype (bf16 under `bf16_mixed`: what autocast computes with anyway).
    `sharded`: FSDP2 like the policy (with `cpu_offload`: `CPUOffloadPolicy`; lean start like the policy);
    one process with `cpu_offload`: decoder layers streamed from host memory
    (`model.reference.stream_layers`)."""
    offload = cpu_offload and device.type == "cuda"
    dtype = precision.compute_dtype or precision.param_dtype
    attn = attention.resolve(config.attn_implementation, device)
    lean = sharded and config.fsdp.lean_start and not is_vision_checkpoint(path)
    if lean:
        model = meta_model(path, dtype, attn_implementation=attn)
    else:
        model = load_model(path, "cpu" if sharded or offload else device, dtype, attn_implementation=attn)
    moe.select_experts(model, device)  # an MoE scorer's experts as grouped GEMMs too
    frozen = freeze(LogProbs(model, config.logprob_head))
    layers = num_decoder_layers(model)
    if sharded:
        shard(frozen, layers, precision, cpu_offload, fsdp_mesh(config.fsdp.replicate, device))
        if lean:
            fill(frozen, "lm", model, path, dtype, _init_device(cpu_offload, device))
            freeze(frozen)
    elif offload:
        stream_layers(model, decoder_layers(model, layers), device)
    return frozen


def _init_device(cpu_offload: bool, device: torch.device) -> torch.device:
    """Where the shards live: host memory with FSDP2's CPU offload, else the rank's device."""
    return torch.device("cpu") if cpu_offload else device


def gradient_checkpointing(config: LearnerConfig, device: torch.device) -> bool:
    """`config.gradient_checkpointing` without a memory plan: None and `auto` on with CUDA, off elsewhere
    (`build_models` resolves them from the plan: plan/auto.py `choose`)."""
    if config.gradient_checkpointing in (None, "auto"):
        return device.type == "cuda"
    return bool(config.gradient_checkpointing)


# --- the LR schedule


def lr_lambda(cfg: OptimizerConfig) -> Callable[[int], float]:
    """LR multiplier at optimizer step s: linear warm-up, then constant / linear / cosine decay."""

    def factor(s: int) -> float:
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.decay == "constant" or cfg.decay_steps is None:
            return 1.0
        frac = min(1.0, (s - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps))
        shape = 1.0 - frac if cfg.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return factor


def set_hparams(parts: Trainables, old: LearnerConfig | None, new: LearnerConfig) -> None:
    """The one place the policy's and the critic's hyper-parameters are set after the build: those of
    `new` that differ from `old` (None = all of them, as after a resume re-aligns the restored optimizer
    and schedule with the config), in place (moments and the schedule's step kept)."""
    if old is None or new.optimizer != old.optimizer:
        set_optimizer_hparams(parts.optimizer, parts.scheduler, new.optimizer)
    if parts.critic_optimizer is not None and (old is None or new.critic.lr != old.critic.lr):
        for g in parts.critic_optimizer.param_groups:
            g["lr"] = new.critic.lr


def set_optimizer_hparams(
    opt: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimizerConfig
) -> None:
    """Apply a new optimizer config in place (moments and the schedule's step kept). The next optimizer
    step trains at `cfg.lr` times the new schedule's factor: `LambdaLR` multiplies its own `base_lrs`, so
    those move too (a PATCH of `optimizer.lr` changing only `initial_lr` would change nothing)."""
    for g in opt.param_groups:
        g.update(betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr for _ in opt.param_groups]
    scheduler.lr_lambdas = [lr_lambda(cfg) for _ in opt.param_groups]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for g in opt.param_groups:
        g["lr"] = cfg.lr * factor


@dataclass
class Built:
    """What `build_models` made: where and how the learner trains, and its models."""

    device: torch.device
    precision: Precision
    memory_plan: MemoryPlan
    parts: Trainables
    publish_keys: set[str]
    reference: torch.nn.Module | None
    startup_host_bytes: int
    """The peak host memory the models' build added (lean start: about this rank's shards)."""
    startup_host_exact: bool
    """False: measured as ru_maxrss, the peak since the process started."""
    grad_sync: str = "micro_batch"
    """`fsdp.grad_sync` resolved (`mini_batch` | `micro_batch`); one process: `micro_batch` (no reduction)."""
    start_way: str = "whole"
    """How the policy's weights were read: `slices` (lean start, each rank its own), `broadcast` (lean start,
    rank 0 read the whole checkpoint), `whole` (one process) or `whole, sharded` (every rank read it all)."""
    settings: Settings | None = None
    """The memory plan's choices: checkpointing and the `auto` token budgets resolved (plan/auto.py)."""
    host_plan: dict[str, float] | None = None
    """This rank's host memory plan in GiB by part, and its node's total (learner/plan/host.py)."""
    teacher: torch.nn.Module | None = None
    """The frozen teacher of on-policy distillation; None without `teacher.model_path`."""


def resolve_grad_sync(
    config: LearnerConfig, plan: MemoryPlan, shard_ranks: int, limit: int | None, ranks: Ranks
) -> tuple[MemoryPlan, str]:
    """`fsdp.grad_sync` for this run, and the plan with the gradients it holds: `mini_batch` keeps the
    unsharded gradients of every micro-batch until the last (fp32, or bf16 under `bf16_pure`), so the plan
    counts them whole; `auto` takes it when that plan fits `limit` and `cpu_offload` is off."""
    if not ranks.distributed:
        return plan, "micro_batch"
    mode = config.fsdp.grad_sync
    if config.fsdp.cpu_offload and mode == "auto":
        mode = "micro_batch"  # the gradients live in host memory: holding them whole would undo that
    # unsharded gradients are in the masters' dtype: the plan's (sharded) gradients x the shard ranks (the
    # weights' size, or under LoRA the adapter's)
    deferred = replace(plan, gradients=plan.gradients * shard_ranks)
    if mode == "auto":
        mode = "mini_batch" if limit is None or deferred.total <= limit else "micro_batch"
    log.info(
        "gradients reduced once per %s (fsdp.grad_sync: %s)",
        "optimizer step" if mode == "mini_batch" else "micro-batch", config.fsdp.grad_sync,
    )  # fmt: skip
    return (deferred if mode == "mini_batch" else plan), mode


def plan_host(config: LearnerConfig, ranks: Ranks, shard_ranks: int) -> dict[str, float]:
    """This rank's host memory plan (GiB by part) and its node's total, checked against the container's
    limit (`MemoryPlanError` naming the knobs); learner/plan/host.py."""
    from transformers import AutoConfig

    shape = ModelShape.of(AutoConfig.from_pretrained(str(config.model_path)), config.lora)
    params, adapter = shape.params, shape.adapter
    teacher = config.teacher.model_path
    taught = ModelShape.of(AutoConfig.from_pretrained(str(teacher))).params if teacher else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ranks.distributed else 1
    leader_node = ranks.rank < per_node
    limit = host_plan.cgroup_limit()
    need = host_plan.check(
        config, params, shard_ranks, per_node, leader_node, limit, teacher_params=taught,
        adapter_params=adapter,
    )  # fmt: skip
    mine = host_plan.host_plan(
        config, params, shard_ranks, ranks.distributed, ranks.is_leader, teacher_params=taught,
        adapter_params=adapter,
    )  # fmt: skip
    return mine.as_dict() | {"node_total": need / GIB}


def build_models(config: LearnerConfig, ranks: Ranks) -> Built:
    """The device and precision, the memory plan checked against the device (before any weight loads),
    then the trainables, the KL reference and the distillation teacher, with the host memory their build
    took."""
    expert_parallel.check_config(config, ranks)  # fsdp.expert_parallel refused before any plan or weight
    device = local_device(ranks, pick_device(config.device))
    precision = Precision.resolve(config.precision, device)
    # the ranks a parameter is sharded over: all of them, or one replica group's (fsdp.replicate)
    shard_ranks = max(1, ranks.world_size // config.fsdp.replicate) if ranks.distributed else 1
    limit = device_limit(config, device)
    # the `auto` settings, the same on every rank (ranks with the same device memory)
    settings = settings_for(config, shard_ranks, ranks.distributed, device.type == "cuda", limit)
    checkpointing = settings.checkpointed_layers
    plan, grad_sync = resolve_grad_sync(config, settings.plan, shard_ranks, limit, ranks)
    check(plan, limit, config, shard_ranks, checkpointing, settings.layers)
    log.info("memory plan %.1f GiB per rank with %s", plan.total / GIB, settings.as_dict())
    log.info("units: %s", units(config))
    host = plan_host(config, ranks, shard_ranks)  # refused here when the node's host plan exceeds its limit
    with host_plan.PeakHostMemory() as startup:  # the models' host memory at start-up (lean start: ~shards)
        parts, publish_keys, start_way = build_trainables(
            config, device, precision, ranks.distributed, checkpointing, settings.compiled_layers
        )
        reference = build_reference(config, device, precision, ranks.distributed, parts.policy)
        teacher = build_teacher(config, device, precision, ranks.distributed)
    log.info(
        "start-up host memory: rank %d peak %d bytes above the %d before the models were built "
        "(lean_start=%s)",
        ranks.rank, startup.added_bytes, startup.base_bytes, ranks.distributed and config.fsdp.lean_start,
    )  # fmt: skip
    return Built(
        device,
        precision,
        plan,
        parts,
        publish_keys,
        reference,
        startup.added_bytes,
        startup.exact,
        grad_sync,
        start_way,
        settings,
        host,
        teacher,
    )
