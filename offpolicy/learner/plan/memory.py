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
  `fp32` 24 h + 16 i + 12 q + 8 kv (8 q + 8 kv more with the norms), under `bf16_pure` and under FSDP's
  bf16 parameters 16 h + 8 i + 6 q + 4 kv; and 11 h outside the layers. Layers compiled by
  `compile_layers` keep fewer: inductor's min-cut partitioner recomputes the norms, the activation and the
  rotary embedding in the backward pass, and keeps the layer's input, the normed inputs, the rotated q and
  k, v, attention's output and the MLP's three intermediates (q and k before their norms too, with them),
  read from the partitioned graph of the real widths: under `bf16_mixed` 10 h + 6 i + 4 (q + kv), 6 (q
  + kv) with the norms; 2 h less on a bf16 stream; under `fp32` the eager count. With activation checkpointing
  only each checkpointed layer's input (h per token and layer, fp32 or bf16 as the residual stream): all
  L layers, or k of them (`checkpoint_layers`), the other L - k keeping their saved tensors. In the backward
  pass one layer is in flight: its gradients (8 h + 4 i), or with checkpointing its saved tensors made
  again (one layer's worth; the gradients are made as those are freed), never at the same time as the LM
  head's chunk (whose backward comes first): the larger counts;
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

Vision-language models (Qwen2.5-VL; `ModelShape.vision`, the tower's parameters): the tower's weights
are counted as any, its gradients, AdamW moments and autocast copies only under `vision.train` (frozen
by default). Image tokens are tokens of the micro-batch (their activations in the decoder counted above).
Not counted: the tower's own activations. Frozen, it runs without gradients before the decoder's forward
and keeps only its output (h per image token, merged into the embeddings); under `vision.train` it keeps
its blocks' saved tensors per patch (4 per image token) until the backward: not yet estimated.

Mixture-of-experts models (`ModelShape.moe`, read from config.json by learner/plan/shape.py): P is every
parameter, the routed experts' E of them included, so the weights, gradients and AdamW state are P as
above, the experts' share E / N per rank (`expert_state`). `ep` (expert parallelism, default 1) divides
each MoE layer's experts over `ep` ranks and FSDP shards them over the N / ep ranks of each group: the
state per rank is E / N still, but the layer FSDP gathers for its compute copies holds its experts / ep
(with ep = 1, every expert of two decoder layers: 2 x 3 x h x i_e x experts each). Activations per token of
a MoE layer: the MLP term counted on the width a token passes through (top_k x `moe_intermediate_size` +
the shared experts'), plus the routing: the router's logits in the compute dtype and its fp32
probabilities (experts per token) and the routed copies of the token, into the experts and out of them
(2 x top_k x h in the stream's dtype); dense layers of the same model (DeepSeek's first ones) as above; the
routing's part is counted from what the experts' backward needs, not yet measured with hooks as the dense
coefficients were.

Deliberately simple: an estimate for decoder-only transformers (coefficients measured with
saved-tensor hooks on Llama and Qwen3 layers), not a measurement (no allocator fragmentation, no NCCL
buffers beyond the 10 % headroom). `check` refuses a plan above 90 % of the device's memory (or
`memory_limit_gib`) with the knobs that lower it. learner/plan/auto.py resolves the `auto` settings
from it: the fewest checkpointed layers that let a micro-batch of at least `MIN_TOKENS` tokens fit, and the
largest token budgets that fit (at most `MAX_TOKENS`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.lora import LoraConfig
from offpolicy.learner.errors import MemoryPlanError
from offpolicy.learner.plan.shape import Experts, count, experts_of, text_config
from offpolicy.weights.processor import is_vision_language

HEADROOM = 0.9
"""The share of the device's memory a plan may use (the rest: CUDA context, NCCL, fragmentation)."""
GIB = 2**30
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
    moe: Experts | None = None  # the mixture-of-experts part (plan/shape.py); None = a dense model
    expert_params: int = 0  # the routed experts' parameters, all layers (part of `params`)
    active: int = 0  # parameters a token passes through (plan/shape.py); 0 = `params` (dense)
    vision: int = 0  # a vision-language model's vision tower (and merger) parameters, part of `params`

    @property
    def active_params(self) -> int:
        """The parameters one token passes through: all of a dense model's; a MoE's but the routed experts
        it is not sent to."""
        return self.active or self.params

    @classmethod
    def of(cls, hf: PretrainedConfig, lora: LoraConfig | None = None) -> ModelShape:
        """The shape of a Hugging Face config; the parameters counted on the meta device (nothing loaded),
        with `lora` those of its adapter too. A vision-language config: the whole model's parameters (its
        vision tower too, also counted apart: `vision`), the language model's sizes (the image tokens are
        tokens of the micro-batch like any; the tower's own activations are not counted: see `estimate`)."""
        vision = getattr(hf, "vision_config", None) is not None
        with torch.device("meta"):
            model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(hf)
        named = dict(model.named_parameters())
        params, names = sum(p.numel() for p in named.values()), list(named)
        hf = hf.get_text_config() if vision else hf
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        moe, experts, active = experts_of(hf.to_dict()), 0, 0
        if moe is not None:  # the experts counted from the config, the total on the meta device
            counts = count(hf.to_dict())
            experts, active = counts.experts, params - (counts.total - counts.active)
        return cls(
            params, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size,
            hf.max_position_embeddings, hf.num_attention_heads * head_dim, kv_heads * head_dim,
            any(n.endswith("q_norm.weight") for n in names),
            0 if lora is None else adapter_params(model, lora), moe, experts, active,
            sum(p.numel() for n, p in named.items() if n.startswith("model.visual.")),
        )  # fmt: skip

    @classmethod
    def of_dict(cls, config: dict) -> ModelShape:
        """The shape of a config.json dict, counted by plan/shape.py (no transformers, nothing built; no
        LoRA adapter): what deploy/sizing.py plans a model by."""
        c, counts = text_config(config), count(config)
        heads, h = c["num_attention_heads"], c["hidden_size"]
        head_dim = c.get("head_dim") or h // heads
        kv = (c.get("num_key_value_heads") or heads) * head_dim
        if c.get("kv_lora_rank"):  # MLA: per head q and k of nope + rope, v of v_head_dim (kv: their mean)
            qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            kv = heads * (qk + c["v_head_dim"]) // 2
        q = heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] if c.get("kv_lora_rank") else head_dim)
        return cls(
            counts.total, h, c.get("intermediate_size") or 0, c["num_hidden_layers"], c["vocab_size"],
            c["max_position_embeddings"], q, kv, c.get("model_type") in ("qwen3", "qwen3_moe"), 0,
            counts.moe, counts.experts, counts.active if counts.moe else 0,
        )  # fmt: skip

    def gathered_layer_params(self, ep: int = 1) -> int:
        """The parameters of the decoder layer FSDP gathers whole (its compute copy): the layers' mean for a
        dense model; for a MoE one, the mean of the rest and one MoE layer's routed experts / `ep`."""
        body = self.params - 2 * self.vocab * self.hidden
        if self.moe is None:
            return body // self.layers
        return (body - self.expert_params) // self.layers + self.expert_params // (self.moe.moe_layers * ep)

    def layer_bytes(self, precision: str, compiled: bool = False, largest: bool = False) -> int:
        """Bytes one decoder layer keeps for the backward pass per token (module docstring); `compiled`:
        the layer under `compile_layers` (inductor's partitioner keeps fewer of them). A MoE model's
        layers differ: their mean (rounded up), or with `largest` the largest."""
        if self.moe is None:
            return self.mlp_layer_bytes(self.intermediate, precision, compiled)
        elt = 4 if precision == "fp32" else 2  # the stream's dtype
        routing = self.moe.routed * (elt + 4) + 2 * self.moe.top_k * self.hidden * elt
        sparse = self.mlp_layer_bytes(self.moe.active_width, precision, compiled) + routing
        dense_layers = self.layers - self.moe.moe_layers
        dense = self.mlp_layer_bytes(self.moe.dense_width, precision, compiled) if dense_layers else 0
        if largest:
            return max(sparse, dense)
        return -(-(self.moe.moe_layers * sparse + dense_layers * dense) // self.layers)

    def mlp_layer_bytes(self, i: int, precision: str, compiled: bool = False) -> int:
        """`layer_bytes` of a decoder layer whose MLP a token passes through is `i` wide."""
        h = self.hidden
        q, kv = self.q_width or h, self.kv_width or h
        norm = self.qk_norm
        if compiled and precision in ("bf16_mixed", "bf16_pure"):
            return (10 if precision == "bf16_mixed" else 8) * h + 6 * i + (4 + 2 * norm) * (q + kv)
        if precision == "fp32":
            return 24 * h + 16 * i + (12 + 8 * norm) * q + (8 + 8 * norm) * kv
        if precision == "bf16_pure":
            return 16 * h + 8 * i + (6 + 6 * norm) * q + (4 + 6 * norm) * kv
        return 26 * h + 8 * i + (6 + 6 * norm) * q + (4 + 6 * norm) * kv

    def in_flight_bytes(self, precision: str, recomputed: bool = True, compiled: bool = False) -> int:
        """Bytes per token of the layer whose backward runs: when it is checkpointed (`recomputed`), its
        saved tensors made again, which the backward frees as it consumes them while it makes the
        gradients (measured: the pair peaks at about the saved tensors alone); without checkpointing (the
        saved tensors already counted in the activations) the gradients it makes on the way, the
        residual's and the MLP's."""
        if recomputed:
            return self.layer_bytes(precision, compiled, largest=True)
        width = self.intermediate if self.moe is None else max(self.moe.active_width, self.moe.dense_width)
        return 8 * self.hidden + 4 * width


def adapter_params(model: torch.nn.Module, lora: LoraConfig) -> int:
    """The parameters a LoRA adapter adds to `model` (on the meta device; injected there by peft, its own
    choice of layers): rank x (in + out) for each targeted linear layer (`all-linear` on a Llama- or
    Qwen-shaped model: q, k, v, o, gate, up and down of every decoder layer), rank x (rows + width) for an
    embedding, plus a whole copy of each module of `modules_to_save`. What AdamW holds under LoRA."""
    from peft import inject_adapter_in_model

    with torch.device("meta"):
        inject_adapter_in_model(lora.peft(is_vision_language(model.config)), model, low_cpu_mem_usage=True)
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
    checkpointing: bool | int,
    cuda: bool,
    reference: ModelShape | None = None,
    tokens: int | None = None,
    teacher: ModelShape | None = None,
    ep: int = 1,
) -> MemoryPlan:
    """The memory plan of one of `ranks` ranks training `shape` (`sharded`: FSDP2 over the ranks) on
    micro-batches of `tokens` tokens (None = `micro_batch_tokens`, `DEFAULT_TOKENS` for `auto`; padded
    rows: `micro_batch_size` rows at the model's context length); the KL loss's reference is of shape
    `reference` (None = `shape`), the distillation teacher of shape `teacher` (None = `shape`).
    `checkpointing`: the number of checkpointed decoder layers, or True (`checkpoint_layers`, else all of
    them) / False (none). `ep`: the expert-parallel size of a MoE model (module docstring; a divisor of
    `ranks`, sharded)."""
    if ep != 1 and (shape.moe is None or not sharded or ranks % ep):
        raise ValueError(f"ep {ep}: expert parallelism needs a MoE model sharded over a multiple of ep ranks")
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
    # a vision-language model's tower is frozen unless `vision.train`: masters, no gradients or moments
    frozen = 0 if config.vision.train else shape.vision
    state = (shape.params * base + (critic + (shape.adapter if lora else 0)) * master) // share
    trained = ((shape.adapter if lora else shape.params - frozen) + critic) * master // share
    offload = sharded and config.fsdp.cpu_offload
    if precision != "bf16_mixed":
        copies = 0
    elif sharded:
        layer = shape.gathered_layer_params(ep)
        copies = 2 * (2 * layer + 2 * shape.vocab * shape.hidden)
    else:  # autocast's bf16 copies of the fp32 weights it caches: those that train (under LoRA: the
        # adapter and the critic alone; a frozen vision tower's are cast on the fly, not cached)
        copies = 2 * (critic + shape.adapter if lora else params - frozen)
    if tokens is None:
        budget = config.micro_batch_tokens
        tokens = (budget if isinstance(budget, int) else DEFAULT_TOKENS) if config.packing else (
            config.micro_batch_size * shape.context
        )  # fmt: skip
    ref_device, ref_host = reference_bytes(config, reference or shape, share, sharded, compute)
    on, offloaded = config.teacher.model_path is not None, config.teacher.cpu_offload
    teacher_device, teacher_host = frozen_bytes(on, offloaded, teacher or shape, share, sharded, compute)
    stream = activation_precision(precision, sharded or lora)
    layers = checkpointed(config, shape.layers, checkpointing)
    compiled = compiles(config, cuda, sharded)
    return MemoryPlan(
        weights=0 if offload else state,
        gradients=0 if offload else trained,
        optimizer=0 if offload else 2 * trained,
        compute_copies=copies,
        activations=tokens * token_bytes(shape, stream, layers, compiled),
        lm_head_chunk=head_bytes(config, shape, compute, cuda),
        host_offloaded=(state + 3 * trained if offload else 0) + ref_host + teacher_host,
        reference=ref_device,
        layer_in_flight=tokens * shape.in_flight_bytes(stream, layers > 0, compiled),
        teacher=teacher_device,
    )


def expert_state(
    config: LearnerConfig, shape: ModelShape, ranks: int, sharded: bool, cuda: bool
) -> dict[str, int]:
    """The routed experts' part of `estimate`'s weights, gradients and optimizer on one rank, in bytes (the
    same under any `ep`: E / N per rank); in host memory under `fsdp.cpu_offload`. All 0 for a dense model.
    Under LoRA the experts are frozen: weights in the compute dtype, no gradients or moments."""
    precision = config.precision or ("bf16_mixed" if cuda else "fp32")
    master, compute = (2 if precision == "bf16_pure" else 4), (4 if precision == "fp32" else 2)
    share = ranks if sharded else 1
    lora = config.lora is not None
    trained = 0 if lora else shape.expert_params * master // share
    weights = shape.expert_params * (compute if lora else master) // share
    return {"weights": weights, "gradients": trained, "optimizer": 2 * trained}


def compiles(config: LearnerConfig, cuda: bool, sharded: bool) -> bool:
    """Whether the decoder layers are compiled: `compile_layers` as set, or `auto`: on CUDA on one process
    without LoRA (the config field's docstring)."""
    if config.compile_layers != "auto":
        return bool(config.compile_layers)
    return cuda and not sharded and config.lora is None


def activation_precision(precision: str, bf16_weights: bool) -> str:
    """The precision the activations follow: bf16 weights (FSDP's bf16 parameters; under LoRA the frozen
    base's own) make `bf16_mixed`'s residual stream bf16, as `bf16_pure`'s (one process with fp32 weights:
    fp32, from the fp32 embeddings)."""
    return "bf16_pure" if bf16_weights and precision == "bf16_mixed" else precision


def checkpointed(config: LearnerConfig, layers: int, checkpointing: bool | int) -> int:
    """How many of a model's `layers` decoder layers recompute their activations: `checkpointing` as a
    count, or True = `config.checkpoint_layers` (all layers when unset), False = none; at most every layer."""
    if isinstance(checkpointing, bool):
        count = (config.checkpoint_layers or layers) if checkpointing else 0
    else:
        count = checkpointing
    return max(0, min(count, layers))


def token_bytes(
    shape: ModelShape, stream: str, checkpointed: int | bool | None, compiled: bool = False
) -> int:
    """Activation bytes kept per token of a micro-batch under activation precision `stream`: every layer's
    saved tensors (`compiled`: under `compile_layers`), but for the `checkpointed` layers (a count; True:
    all) only their input; None: a pass without gradients, which keeps one layer's working set alone (its
    eager one: an upper bound); and the states outside the layers."""
    if checkpointed is None:
        return shape.layer_bytes(stream, largest=True) + 11 * shape.hidden
    k = shape.layers if checkpointed is True else int(checkpointed)
    layer_input = shape.hidden * (2 if stream == "bf16_pure" else 4)
    saved = shape.layer_bytes(stream, compiled)
    return k * layer_input + (shape.layers - k) * saved + 11 * shape.hidden


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


def device_limit(config: LearnerConfig, device: torch.device) -> int | None:
    """The bytes a rank may plan for: `memory_limit_gib`, else 90 % of the CUDA device; None on CPU."""
    if config.memory_limit_gib is not None:
        return int(config.memory_limit_gib * GIB)
    if device.type == "cuda":
        return int(HEADROOM * torch.cuda.get_device_properties(device).total_memory)
    return None


def check(
    plan: MemoryPlan,
    limit: int | None,
    config: LearnerConfig,
    ranks: int,
    checkpointing: bool | int,
    layers: int | None = None,
) -> None:
    """Refuse a plan above `limit` (`MemoryPlanError`), naming the parts and the knobs that lower them (the
    levers left: checkpointing more layers only while fewer than all `layers` are)."""
    if limit is None or plan.total <= limit:
        return
    parts = ", ".join(
        f"{k} {v:.1f}" for k, v in plan.as_dict().items() if k not in ("total", "host_offloaded")
    )
    every_layer = checkpointing is True or (
        bool(layers) and checkpointing is not False and checkpointing >= layers
    )
    now = f"{checkpointing} of {layers or 'all'}"
    levers = [
        f"lower micro_batch_tokens (now {config.micro_batch_tokens})",
        f"shard over more ranks (--nproc-per-node, now {ranks})",
        *([] if config.fsdp.cpu_offload else ["set fsdp.cpu_offload: true"]),
        *([] if every_layer else [f"checkpoint more layers (gradient_checkpointing: true, now {now})"]),
        f"lower logprob_chunk_tokens (now {config.logprob_chunk_tokens})",
        *([] if config.lora is not None else ["train a LoRA adapter (lora:)"]),
    ]
    raise MemoryPlanError(
        f"the memory plan needs ~{plan.total / GIB:.1f} GiB per rank ({parts} GiB) but {limit / GIB:.1f} GiB "
        f"are available: {', '.join(levers[:-1])} or {levers[-1]}"
        + ("; every layer is checkpointed already" if every_layer else "")
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
