"""The learner's `auto` settings, resolved from its memory plan (learner/plan/memory.py) before any weight
loads, the same on every rank:

- `gradient_checkpointing: auto`: how many decoder layers recompute their activations in the backward
  pass. None when a micro-batch of the training budget (at least `MIN_TOKENS` tokens under
  `micro_batch_tokens: auto`) fits without it; else `checkpoint_layers` when set; else the fewest layers
  that let it fit (each costs its forward again: ~1/3 of its training FLOPs), all of them when even that
  does not. Per-layer checkpointing, torchtitan's "selective layer" way: the chosen layers are spread
  evenly through the stack (learner/model/recompute.py).
- `micro_batch_tokens: auto`: the largest budget the plan admits with that checkpointing (a multiple of
  1,024, at most `MAX_TOKENS`; `DEFAULT_TOKENS` without a device limit, as on CPU).
- `no_grad_micro_batch_tokens`: the pi_old (and reference, teacher) passes keep no activations: `auto` is
  the largest budget whose one layer's working set fits; None = the training budget.

What was chosen is logged at start, reported in `/v1/status` (`settings`) and in benchmarks/learner.py's
JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.plan.memory import (
    DEFAULT_TOKENS,
    MemoryPlan,
    ModelShape,
    activation_precision,
    checkpointed,
    compiles,
    estimate,
    shapes_of,
    teacher_shape,
    token_bytes,
)

MIN_TOKENS = 16384
"""`auto` checkpoints the fewest layers that let micro-batches of at least this many tokens fit."""
MAX_TOKENS = 262144
"""The largest budget `auto` picks (a micro-batch beyond a whole batch has no use)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """What the memory plan decides for a run: the `auto` settings resolved, and the plan they make."""

    checkpointed_layers: int
    """Decoder layers whose activations are recomputed in the backward pass (0: none)."""
    micro_batch_tokens: int
    no_grad_micro_batch_tokens: int
    plan: MemoryPlan
    layers: int = 0
    """The model's decoder layers (for the report)."""
    compiled_layers: bool = False
    """Whether the decoder layers are compiled (`compile_layers`, `auto` resolved: plan/memory.py
    `compiles`)."""

    @property
    def checkpointing(self) -> bool:
        """Whether any layer is checkpointed."""
        return self.checkpointed_layers > 0

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
        """The chosen settings (logs, `/v1/status`, the benchmark's JSON)."""
        return {
            "gradient_checkpointing": self.checkpointing,
            "checkpointed_layers": self.checkpointed_layers,
            "decoder_layers": self.layers,
            "micro_batch_tokens": self.micro_batch_tokens,
            "no_grad_micro_batch_tokens": self.no_grad_micro_batch_tokens,
            "compile_layers": self.compiled_layers,
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
    """Resolve `gradient_checkpointing` (None = `auto` on CUDA, off elsewhere) to a number of checkpointed
    layers, `micro_batch_tokens` and `no_grad_micro_batch_tokens` against `limit` bytes (None: no limit,
    as on CPU); module docstring. The plan is that of the chosen settings (`check` refuses it if it does
    not fit)."""
    precision = config.precision or ("bf16_mixed" if cuda else "fp32")
    stream = activation_precision(precision, sharded or config.lora is not None)
    compiled = compiles(config, cuda, sharded)
    ep = config.fsdp.expert_parallel if sharded else 1  # the mesh's expert-parallel size (one process: 1)

    def largest(layers: int | None) -> int:  # tokens that fit beside the fixed parts (None: no-grad)
        if limit is None:
            return DEFAULT_TOKENS
        fixed = estimate(config, shape, ranks, sharded, 0, cuda, reference, tokens=0, teacher=teacher, ep=ep)
        kept = token_bytes(shape, stream, layers, compiled)
        layer = 0 if layers is None else shape.in_flight_bytes(stream, layers > 0, compiled)
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
        layers = 0 if limit is None or largest(0) >= needed else fewest(config, shape, needed, largest)
    else:
        layers = checkpointed(config, shape.layers, setting)
    tokens = budget if isinstance(budget, int) else largest(layers)
    no_grad = config.no_grad_micro_batch_tokens
    if no_grad is None:
        no_grad = tokens
    elif no_grad == "auto":
        no_grad = tokens if limit is None else max(tokens, largest(None))
    tokens_planned = tokens if config.packing else None
    plan = estimate(config, shape, ranks, sharded, layers, cuda, reference, tokens_planned, teacher, ep=ep)
    return Settings(layers, tokens, no_grad, plan, shape.layers, compiled)


def fewest(config: LearnerConfig, shape: ModelShape, needed: int, largest) -> int:
    """The checkpointed layers `auto` takes when `needed` tokens do not fit without any: `checkpoint_layers`
    when set, else the fewest with which they fit (`largest(k)`: the tokens that fit with k), else all."""
    if config.checkpoint_layers is not None:
        return min(config.checkpoint_layers, shape.layers)
    return next((k for k in range(1, shape.layers + 1) if largest(k) >= needed), shape.layers)


def settings_for(config: LearnerConfig, ranks: int, sharded: bool, cuda: bool, limit: int | None) -> Settings:
    """`choose` for the model `config.model_path` names."""
    shape, reference = shapes_of(config)
    return choose(config, shape, ranks, sharded, cuda, limit, reference, teacher_shape(config))
