"""The memory plan of one learner rank, estimated before any weight is loaded, and refused if it cannot fit.

Per rank, in bytes (P = the policy's parameters, plus the critic's under GAE; N = the ranks sharing them
under FSDP, 1 on one process):

- weights: P x the master dtype (4 B fp32 under `bf16_mixed` and `fp32`, 2 B under `bf16_pure`) / N;
- gradients: the same; AdamW: two moments, 2 x that. With `fsdp.cpu_offload` all three live in host memory;
- compute copies under `bf16_mixed`: on one process autocast caches a bf16 copy of every weight for the
  forward (2 P); under FSDP only the layers being gathered are whole (two decoder layers, prefetch, plus the
  root: embeddings and LM head);
- activations of one micro-batch of T = `micro_batch_tokens` tokens (padded rows: `micro_batch_size` rows
  at the model's context length, their worst case) in the compute dtype: per token and
  layer ~(9 h + 4 i) elements (h hidden, i MLP width; attention without T x T scores: FlashAttention or
  `sdpa_varlen`); with activation checkpointing only each layer's input (h per token and layer) plus one
  layer recomputed;
- the LM head's chunk: `logprob_chunk_tokens` x vocabulary fp32 logits, three live at once (logits,
  their softmax, their gradient), four with the entropy bonus (`entropy_coeff > 0`: its gradient);
- the reference policy of the KL loss (`kl_loss_coef > 0`): P_ref x the compute dtype (2 B under
  `bf16_mixed` and `bf16_pure`, 4 B under `fp32`) / N; with `reference.cpu_offload` in host memory (on one
  process its embeddings and LM head stay on the device; the layers it gathers or streams exist only during
  its own no-grad pass, when no training activations are alive).

Deliberately simple: an upper-bound-minded estimate for decoder-only transformers, not a measurement (no
allocator fragmentation, no NCCL buffers beyond the 10 % headroom). `check` refuses a plan above 90 % of
the device's memory (or `memory_limit_gib`) with the knobs that lower it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.errors import MemoryPlanError

HEADROOM = 0.9
"""The share of the device's memory a plan may use (the rest: CUDA context, NCCL, fragmentation)."""
GIB = 2**30


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs of a model: parameter count and sizes."""

    params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    context: int  # max_position_embeddings: a padded row's worst case

    @classmethod
    def of(cls, hf: PretrainedConfig) -> ModelShape:
        """The shape of a Hugging Face config; the parameters counted on the meta device (nothing loaded)."""
        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
        return cls(
            params, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size,
            hf.max_position_embeddings,
        )  # fmt: skip


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
    # reference's weights with `reference.cpu_offload`
    reference: int = 0  # the KL loss's frozen reference policy on the device

    @property
    def total(self) -> int:
        return sum((self.weights, self.gradients, self.optimizer, self.compute_copies, self.activations,
                    self.lm_head_chunk, self.reference))  # fmt: skip

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
) -> MemoryPlan:
    """The memory plan of one of `ranks` ranks training `shape` (`sharded`: FSDP2 over the ranks); the KL
    loss's reference is of shape `reference` (None = `shape`)."""
    precision = config.precision or ("bf16_mixed" if cuda else "fp32")
    master = 2 if precision == "bf16_pure" else 4
    compute = 4 if precision == "fp32" else 2
    params = shape.params * (2 if config.adv_estimator == "gae" else 1)  # the critic: a second backbone
    share = ranks if sharded else 1
    state = params * master // share
    offload = sharded and config.fsdp.cpu_offload
    if precision != "bf16_mixed":
        copies = 0
    elif sharded:
        layer = (shape.params - 2 * shape.vocab * shape.hidden) // shape.layers
        copies = 2 * (2 * layer + 2 * shape.vocab * shape.hidden)
    else:
        copies = 2 * params
    tokens = config.micro_batch_tokens if config.packing else config.micro_batch_size * shape.context
    per_layer = tokens * (9 * shape.hidden + 4 * shape.intermediate) * compute
    if checkpointing:
        activations = shape.layers * tokens * shape.hidden * compute + per_layer
    else:
        activations = shape.layers * per_layer
    head = (4 if config.entropy_coeff > 0 else 3) * config.logprob_chunk_tokens * shape.vocab * 4
    ref_device, ref_host = reference_bytes(config, reference or shape, share, sharded, compute)
    return MemoryPlan(
        weights=0 if offload else state,
        gradients=0 if offload else state,
        optimizer=0 if offload else 2 * state,
        compute_copies=copies,
        activations=activations,
        lm_head_chunk=head,
        host_offloaded=(4 * state if offload else 0) + ref_host,
        reference=ref_device,
    )


def reference_bytes(
    config: LearnerConfig, shape: ModelShape, share: int, sharded: bool, compute: int
) -> tuple[int, int]:
    """(device, host) bytes of the KL loss's reference policy on one rank (in the compute dtype, sharded
    over `share` ranks); (0, 0) when `kl_loss_coef` is 0."""
    if config.kl_loss_coef == 0:
        return 0, 0
    full = shape.params * compute // share
    if not config.reference.cpu_offload:
        return full, 0
    # in host memory; what it gathers or streams onto the device lives only during its own pass, when no
    # training activations are alive; on one process its embeddings and LM head stay on the device
    return (0 if sharded else 2 * shape.vocab * shape.hidden * compute), full


def plan_for(config: LearnerConfig, ranks: int, sharded: bool, checkpointing: bool, cuda: bool) -> MemoryPlan:
    """`estimate` for the model `config.model_path` names (its config read, no weight loaded)."""
    shape = ModelShape.of(AutoConfig.from_pretrained(str(config.model_path)))
    ref_path = config.reference.model_path
    reference = None
    if config.kl_loss_coef > 0 and ref_path is not None:
        reference = ModelShape.of(AutoConfig.from_pretrained(str(ref_path)))
    return estimate(config, shape, ranks, sharded, checkpointing, cuda, reference)


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
    )
