"""The memory plan of one learner rank, estimated before any weight is loaded, and refused if it cannot fit.

Per rank, in bytes (P = the policy's parameters, plus the critic's under GAE; N = the ranks sharing them
under FSDP, 1 on one process):

- weights: P x the master dtype (4 B fp32 under `bf16_mixed` and `fp32`, 2 B under `bf16_pure`) / N;
- gradients: the same; AdamW: two moments, 2 x that. With `fsdp.cpu_offload` all three live in host memory.
  Under LoRA (`lora`) the weights are the frozen base's and the adapter's (A = rank x (in + out) per
  targeted layer, `adapter_params`), gradients and moments the adapter's alone (A, not P);
- compute copies under `bf16_mixed`: on one process autocast caches a bf16 copy of every weight for the
  forward (2 P); under FSDP only the layers being gathered are whole (two decoder layers, prefetch, plus the
  root: embeddings and LM head);
- activations of one micro-batch of T = `micro_batch_tokens` tokens (padded rows: `micro_batch_size` rows
  at the model's context length, their worst case), measured per token and decoder layer (bytes saved for
  the backward pass, h hidden, i MLP width, q and kv the query and key/value widths, attention without
  T x T scores: FlashAttention, `torch_varlen` or `sdpa_varlen`): under `bf16_mixed` 26 h + 8 i + 6 q
  + 4 kv (the residual stream stays fp32; 6 q + 6 kv more with per-head q/k norms, as Qwen3), under
  `fp32` 24 h + 16 i + 12 q + 8 kv, under `bf16_pure` and under FSDP's bf16 parameters 16 h + 8 i + 6 q
  + 4 kv; and 11 h outside the layers. With activation checkpointing only each layer's input (h per token
  and layer, fp32 or bf16 as the residual stream). One layer's worth and its gradients (8 h + 4 i more)
  are in flight during the backward pass, never at the same time as the LM head's chunk (whose backward
  comes first): the larger counts;
- the LM head's chunk of `logprob_chunk_tokens` x vocabulary logits: the `fused` head (model/head.py) holds
  the logits and their gradient in the compute dtype (compiled on CUDA; eagerly one fp32 copy and the
  softmax more), the `chunked` one three fp32 copies, four with the entropy bonus;
- the reference policy of the KL loss (`kl_loss_coef > 0`): P_ref x the compute dtype (2 B under
  `bf16_mixed` and `bf16_pure`, 4 B under `fp32`) / N; with `reference.cpu_offload` in host memory (on one
  process its embeddings and LM head stay on the device; the layers it gathers or streams exist only during
  its own no-grad pass, when no training activations are alive); none under LoRA without
  `reference.model_path` (the policy with its adapter off);
- the teacher of on-policy distillation (`teacher.model_path` set): counted as the reference is, with its
  own shape and `teacher.cpu_offload`.

Deliberately simple: an estimate for decoder-only transformers (coefficients measured with
saved-tensor hooks on Llama and Qwen3 layers), not a measurement (no allocator fragmentation, no NCCL
buffers beyond the 10 % headroom). `check` refuses a plan above 90 % of the device's memory (or
`memory_limit_gib`) with the knobs that lower it. `choose` resolves the `auto` settings from it:
activation checkpointing off when at least `MIN_TOKENS` tokens fit without it, and the largest token
budgets that fit (at most `MAX_TOKENS`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.lora import LoraConfig
from offpolicy.learner.errors import MemoryPlanError

HEADROOM = 0.9
"""The share of the device's memory a plan may use (the rest: CUDA context, NCCL, fragmentation)."""
GIB = 2**30
MIN_TOKENS = 16384
"""`auto` turns activation checkpointing off only when micro-batches of at least this many tokens fit."""
MAX_TOKENS = 262144
"""The largest budget `auto` picks (a micro-batch beyond a whole batch has no use)."""
DEFAULT_TOKENS = 16384
"""What `micro_batch_tokens: auto` means where the device sets no limit (CPU without memory_limit_gib)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs of a model: parameter count and sizes."""

    params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    context: int  # max_position_embeddings: a padded row's worst case
    q_width: int = 0  # query heads x head_dim; 0 = hidden
    kv_width: int = 0  # key/value heads x head_dim; 0 = hidden
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3)
    adapter: int = 0  # the LoRA adapter's parameters (`lora` set; `adapter_params`); 0 = none

    @classmethod
    def of(cls, hf: PretrainedConfig, lora: LoraConfig | None = None) -> ModelShape:
        """The shape of a Hugging Face config; the parameters counted on the meta device (nothing loaded),
        with `lora` those of its adapter too."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        named = dict(model.named_parameters())
        params, names = sum(p.numel() for p in named.values()), list(named)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        return cls(
            params, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size,
            hf.max_position_embeddings, hf.num_attention_heads * head_dim, kv_heads * head_dim,
            any(n.endswith("q_norm.weight") for n in names),
            0 if lora is None else adapter_params(model, lora),
        )  # fmt: skip

    def layer_bytes(self, precision: str) -> int:
        """Bytes one decoder layer keeps for the backward pass per token (module docstring)."""
        h, i = self.hidden, self.intermediate
        q, kv = self.q_width or h, self.kv_width or h
        norm = self.qk_norm
        if precision == "fp32":
            return 24 * h + 16 * i + (12 + 12 * norm) * q + (8 + 12 * norm) * kv
        if precision == "bf16_pure":
            return 16 * h + 8 * i + (6 + 6 * norm) * q + (4 + 6 * norm) * kv
        return 26 * h + 8 * i + (6 + 6 * norm) * q + (4 + 6 * norm) * kv

    def in_flight_bytes(self, precision: str) -> int:
        """Bytes per token of the layer whose backward runs: its saved tensors (recomputed under activation
        checkpointing) and the gradients it makes on the way (the residual's, the MLP's)."""
        return self.layer_bytes(precision) + 8 * self.hidden + 4 * self.intermediate


def adapter_params(model: torch.nn.Module, lora: LoraConfig) -> int:
    """The parameters a LoRA adapter adds to `model` (on the meta device; injected there by peft, its own
    choice of layers): rank x (in + out) for each targeted linear layer (`all-linear` on a Llama- or
    Qwen-shaped model: q, k, v, o, gate, up and down of every decoder layer), rank x (rows + width) for an
    embedding, plus a whole copy of each module of `modules_to_save`. What AdamW holds under LoRA."""
    from peft import inject_adapter_in_model

    with torch.device("meta"):
        inject_adapter_in_model(lora.peft(), model, low_cpu_mem_usage=True)
    # peft marks the adapter (factors and `modules_to_save` copies) trainable, everything else frozen
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Estimated bytes per rank, by part; `total` is what `check` compares with the device."""

    weights: int
    gradients: int
    optimizer: int
    compute_copies: int
    activations: int
    lm_head_chunk: int
    host_offloaded: int  # weights, gradients and AdamW state in host memory (`fsdp.cpu_offload`), and the
    # reference's and the teacher's weights with their `cpu_offload`
    reference: int = 0  # the KL loss's frozen reference policy on the device
    layer_in_flight: int = 0  # one decoder layer's working set in the backward pass (never at the same
    # time as the LM head's chunk, whose backward comes first)
    teacher: int = 0  # the distillation teacher on the device

    @property
    def total(self) -> int:
        return sum((self.weights, self.gradients, self.optimizer, self.compute_copies, self.activations,
                    max(self.lm_head_chunk, self.layer_in_flight), self.reference, self.teacher))  # fmt: skip

    def as_dict(self) -> dict[str, float]:
        """The parts and the total in GiB (JSON-safe: `/v1/status`)."""
        return {k: v / GIB for k, v in asdict(self).items()} | {"total": self.total / GIB}


def estimate(
    config: LearnerConfig,
    shape: ModelShape,
    ranks: int,
    sharded: bool,
    checkpointing: bool,
    cuda: bool,
    reference: ModelShape | None = None,
    tokens: int | None = None,
    teacher: ModelShape | None = None,
) -> MemoryPlan:
    """The memory plan of one of `ranks` ranks training `shape` (`sharded`: FSDP2 over the ranks) on
    micro-batches of `tokens` tokens (None = `micro_batch_tokens`, `DEFAULT_TOKENS` for `auto`; padded
    rows: `micro_batch_size` rows at the model's context length); the KL loss's reference is of shape
    `reference` (None = `shape`), the distillation teacher of shape `teacher` (None = `shape`)."""
    precision = config.precision or ("bf16_mixed" if cuda else "fp32")
    master = 2 if precision == "bf16_pure" else 4
    compute = 4 if precision == "fp32" else 2
    critic = shape.params if config.adv_estimator == "gae" else 0  # the critic: a second backbone
    params = shape.params + critic
    # under LoRA the frozen base is kept in the compute dtype (no masters), its adapter in the masters';
    # only the adapter (and the critic) has gradients and AdamW moments
    lora = config.lora is not None
    share = ranks if sharded else 1
    base = compute if lora else master
    state = (shape.params * base + (critic + (shape.adapter if lora else 0)) * master) // share
    trained = ((shape.adapter if lora else shape.params) + critic) * master // share
    offload = sharded and config.fsdp.cpu_offload
    if precision != "bf16_mixed":
        copies = 0
    elif sharded:
        layer = (shape.params - 2 * shape.vocab * shape.hidden) // shape.layers
        copies = 2 * (2 * layer + 2 * shape.vocab * shape.hidden)
    else:  # autocast's bf16 copies of the fp32 weights (under LoRA: of the adapter and the critic alone)
        copies = 2 * (critic + shape.adapter if lora else params)
    if tokens is None:
        budget = config.micro_batch_tokens
        tokens = (budget if isinstance(budget, int) else DEFAULT_TOKENS) if config.packing else (
            config.micro_batch_size * shape.context
        )  # fmt: skip
    ref_device, ref_host = reference_bytes(config, reference or shape, share, sharded, compute)
    on, offloaded = config.teacher.model_path is not None, config.teacher.cpu_offload
    teacher_device, teacher_host = frozen_bytes(on, offloaded, teacher or shape, share, sharded, compute)
    stream = activation_precision(precision, sharded or lora)
    return MemoryPlan(
        weights=0 if offload else state,
        gradients=0 if offload else trained,
        optimizer=0 if offload else 2 * trained,
        compute_copies=copies,
        activations=tokens * token_bytes(shape, stream, checkpointing),
        lm_head_chunk=head_bytes(config, shape, compute, cuda),
        host_offloaded=(state + 3 * trained if offload else 0) + ref_host + teacher_host,
        reference=ref_device,
        layer_in_flight=tokens * shape.in_flight_bytes(stream),
        teacher=teacher_device,
    )


def activation_precision(precision: str, bf16_weights: bool) -> str:
    """The precision the activations follow: bf16 weights (FSDP's bf16 parameters; under LoRA the frozen
    base's own) make `bf16_mixed`'s residual stream bf16, as `bf16_pure`'s (one process with fp32 weights:
    fp32, from the fp32 embeddings)."""
    return "bf16_pure" if bf16_weights and precision == "bf16_mixed" else precision


def token_bytes(shape: ModelShape, stream: str, checkpointing: bool | None) -> int:
    """Activation bytes kept per token of a micro-batch under activation precision `stream`: every layer's
    saved tensors (with `checkpointing` each layer's input instead; None: a pass without gradients, which
    keeps one layer's working set alone) and the states outside the layers."""
    if checkpointing is None:
        return shape.layer_bytes(stream) + 11 * shape.hidden
    layer = shape.hidden * (2 if stream == "bf16_pure" else 4) if checkpointing else shape.layer_bytes(stream)
    return shape.layers * layer + 11 * shape.hidden


def head_bytes(config: LearnerConfig, shape: ModelShape, compute: int, cuda: bool) -> int:
    """The LM head's chunk of `logprob_chunk_tokens` x vocabulary logits at its largest (module docstring)."""
    entropy = config.entropy_coeff > 0
    if config.logprob_head == "chunked":
        per_logit = 4 * (4 if entropy else 3)
    elif cuda:
        per_logit = 2 * compute  # the logits and their gradient; the passes over them compiled
    else:
        per_logit = compute + 8 + 4 * entropy  # and one fp32 copy, the softmax (the entropy's)
    weight_grad = 0 if config.logprob_head == "chunked" else (2 * compute + 4) * shape.vocab * shape.hidden
    return per_logit * config.logprob_chunk_tokens * shape.vocab + weight_grad


def reference_bytes(
    config: LearnerConfig, shape: ModelShape, share: int, sharded: bool, compute: int
) -> tuple[int, int]:
    """(device, host) bytes of the KL loss's reference policy on one rank (in the compute dtype, sharded
    over `share` ranks); (0, 0) when `kl_loss_coef` is 0, or when the reference is the policy's base model
    with its adapter off (`adapter_reference`: no second copy)."""
    on = config.kl_loss_coef > 0 and not config.adapter_reference
    return frozen_bytes(on, config.reference.cpu_offload, shape, share, sharded, compute)


def frozen_bytes(
    on: bool, cpu_offload: bool, shape: ModelShape, share: int, sharded: bool, compute: int
) -> tuple[int, int]:
    """(device, host) bytes of a frozen scorer (the KL reference, the distillation teacher) on one rank, in
    the compute dtype, sharded over `share` ranks; (0, 0) when it is not loaded (`on` False)."""
    if not on:
        return 0, 0
    full = shape.params * compute // share
    if not cpu_offload:
        return full, 0
    # in host memory; what it gathers or streams onto the device lives only during its own pass, when no
    # training activations are alive; on one process its embeddings and LM head stay on the device
    return (0 if sharded else 2 * shape.vocab * shape.hidden * compute), full


@dataclass(frozen=True, slots=True)
class Settings:
    """What the memory plan decides for a run: the `auto` settings resolved, and the plan they make."""

    checkpointing: bool
    micro_batch_tokens: int
    no_grad_micro_batch_tokens: int
    plan: MemoryPlan

    def apply(self, config: LearnerConfig) -> LearnerConfig:
        """`config` with its `auto` (and unset no-grad) token budgets replaced by the chosen numbers."""
        update: dict[str, int] = {}
        if config.micro_batch_tokens == "auto":
            update["micro_batch_tokens"] = self.micro_batch_tokens
        if not isinstance(config.no_grad_micro_batch_tokens, int):
            update["no_grad_micro_batch_tokens"] = (
                self.no_grad_micro_batch_tokens
                if config.no_grad_micro_batch_tokens == "auto"
                else update.get("micro_batch_tokens", config.micro_batch_tokens)
            )
        return config.model_copy(update=update) if update else config

    def as_dict(self) -> dict[str, int | bool]:
        """The chosen settings (logs, the benchmark's JSON)."""
        return {
            "gradient_checkpointing": self.checkpointing,
            "micro_batch_tokens": self.micro_batch_tokens,
            "no_grad_micro_batch_tokens": self.no_grad_micro_batch_tokens,
        }


def choose(
    config: LearnerConfig,
    shape: ModelShape,
    ranks: int,
    sharded: bool,
    cuda: bool,
    limit: int | None,
    reference: ModelShape | None = None,
    teacher: ModelShape | None = None,
) -> Settings:
    """Resolve `gradient_checkpointing` (None = `auto` on CUDA, off elsewhere), `micro_batch_tokens` and
    `no_grad_micro_batch_tokens` against `limit` bytes (None: no limit, as on CPU): checkpointing `auto` is
    off when the micro-batch (at least `MIN_TOKENS` tokens under `auto`) fits without it; a budget `auto`
    is the largest that fits (a multiple of 1,024, at most `MAX_TOKENS`; `DEFAULT_TOKENS` or the training
    budget without a limit). The plan is that of the chosen settings (`check` refuses it if it does not
    fit)."""
    precision = config.precision or ("bf16_mixed" if cuda else "fp32")
    stream = activation_precision(precision, sharded or config.lora is not None)

    def largest(checkpointing: bool | None) -> int:  # tokens that fit beside the fixed parts
        if limit is None:
            return DEFAULT_TOKENS
        fixed = estimate(
            config, shape, ranks, sharded, bool(checkpointing), cuda, reference, tokens=0, teacher=teacher
        )
        kept = token_bytes(shape, stream, checkpointing)
        layer = 0 if checkpointing is None else shape.in_flight_bytes(stream)
        room = limit - fixed.total + fixed.lm_head_chunk  # the head's chunk, or a layer in flight
        tokens = min((room - fixed.lm_head_chunk) // kept, room // (kept + layer))
        return min(MAX_TOKENS, max(1024, tokens // 1024 * 1024))

    budget, setting = config.micro_batch_tokens, config.gradient_checkpointing
    if setting is None:
        setting = "auto" if cuda else False
    if setting == "auto":
        needed = budget if isinstance(budget, int) else MIN_TOKENS
        if not config.packing:
            needed = config.micro_batch_size * shape.context
        setting = limit is not None and largest(False) < needed
    tokens = budget if isinstance(budget, int) else largest(setting)
    no_grad = config.no_grad_micro_batch_tokens
    if no_grad is None:
        no_grad = tokens
    elif no_grad == "auto":
        no_grad = tokens if limit is None else max(tokens, largest(None))
    tokens_planned = tokens if config.packing else None
    plan = estimate(config, shape, ranks, sharded, setting, cuda, reference, tokens_planned, teacher)
    return Settings(setting, tokens, no_grad, plan)


def shapes_of(config: LearnerConfig) -> tuple[ModelShape, ModelShape | None]:
    """The shapes of the policy `config.model_path` names and of the KL loss's reference when it is
    another model (their configs read, no weight loaded)."""
    shape = ModelShape.of(AutoConfig.from_pretrained(str(config.model_path)), config.lora)
    ref_path = config.reference.model_path
    if config.kl_loss_coef > 0 and ref_path is not None:
        return shape, ModelShape.of(AutoConfig.from_pretrained(str(ref_path)))
    return shape, None


def teacher_shape(config: LearnerConfig) -> ModelShape | None:
    """The shape of the distillation teacher (its config read, no weight loaded); None without one."""
    path = config.teacher.model_path
    return None if path is None else ModelShape.of(AutoConfig.from_pretrained(str(path)))


def plan_for(config: LearnerConfig, ranks: int, sharded: bool, checkpointing: bool, cuda: bool) -> MemoryPlan:
    """`estimate` for the model `config.model_path` names."""
    shape, reference = shapes_of(config)
    teacher = teacher_shape(config)
    return estimate(config, shape, ranks, sharded, checkpointing, cuda, reference, teacher=teacher)


def settings_for(config: LearnerConfig, ranks: int, sharded: bool, cuda: bool, limit: int | None) -> Settings:
    """`choose` for the model `config.model_path` names."""
    shape, reference = shapes_of(config)
    return choose(config, shape, ranks, sharded, cuda, limit, reference, teacher_shape(config))


def device_limit(config: LearnerConfig, device: torch.device) -> int | None:
    """The bytes a rank may plan for: `memory_limit_gib`, else 90 % of the CUDA device; None on CPU."""
    if config.memory_limit_gib is not None:
        return int(config.memory_limit_gib * GIB)
    if device.type == "cuda":
        return int(HEADROOM * torch.cuda.get_device_properties(device).total_memory)
    return None


def check(
    plan: MemoryPlan, limit: int | None, config: LearnerConfig, ranks: int, checkpointing: bool
) -> None:
    """Refuse a plan above `limit` (`MemoryPlanError`), naming the parts and the knobs that lower them."""
    if limit is None or plan.total <= limit:
        return
    parts = ", ".join(
        f"{k} {v:.1f}" for k, v in plan.as_dict().items() if k not in ("total", "host_offloaded")
    )
    raise MemoryPlanError(
        f"the memory plan needs ~{plan.total / GIB:.1f} GiB per rank ({parts} GiB) but {limit / GIB:.1f} GiB "
        f"are available: lower micro_batch_tokens (now {config.micro_batch_tokens}), shard over more ranks "
        f"(--nproc-per-node, now {ranks}), set fsdp.cpu_offload: true (now {config.fsdp.cpu_offload}), "
        f"turn gradient_checkpointing on (now {checkpointing}), or lower logprob_chunk_tokens (now "
        f"{config.logprob_chunk_tokens})"
        + (
            f"; the KL loss's reference takes {plan.reference / GIB:.1f}: set reference.cpu_offload: true"
            if plan.reference and not config.reference.cpu_offload
            else ""
        )
        + (
            f"; the distillation teacher takes {plan.teacher / GIB:.1f}: set teacher.cpu_offload: true"
            if plan.teacher and not config.teacher.cpu_offload
            else ""
        )
    )
