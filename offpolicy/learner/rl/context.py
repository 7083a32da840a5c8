"""What one learner step trains with: a frozen context the trainer builds at each step boundary.

The algorithm (rl/step.py, rl/update.py) reads everything it needs from a `StepContext` and returns what it
did; it never holds the trainer, and the trainer alone changes its own state (the policy version, the step
count) from what comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from offpolicy.learner.build import Trainables
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.distributed.ranks import Ranks
    from offpolicy.learner.metrics import LearnerMetrics
    from offpolicy.learner.model.precision import Precision


@dataclass(frozen=True, slots=True)
class StepContext:
    """The inputs of one learner step on this rank."""

    config: LearnerConfig
    device: torch.device
    precision: Precision
    ranks: Ranks
    pad_id: int  # the tokenizer's pad token id (collate pads with it)
    version: int  # the policy version before the step (optimizer steps taken so far)
    step_count: int  # learner steps completed before this one (seeds the mini-batch order)
    trainables: Trainables
    reference: torch.nn.Module | None  # the frozen reference policy of the KL loss; None when it is off
    before_update: Callable[[dict[str, float]], None]  # runs before each optimizer step changes the weights
    metrics: LearnerMetrics | None  # the histograms only rank 0 exports; None on the other ranks
    grad_sync: str = "micro_batch"  # `fsdp.grad_sync` as resolved at start: mini_batch | micro_batch
    teacher: torch.nn.Module | None = None  # the frozen teacher of on-policy distillation; None when off
    image_processor: Any = None  # a vision-language policy's image processor (model/vision.py); else None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one learner step did: its metrics (host floats), how many optimizer steps it took, and per group
    (in the order of the groups it trained) the mean |log pi_old - log mu| over its kept tokens (0 in bypass
    mode; rl/priorities.py `group_is_deviation`), computed under `priorities.update` alone (else empty)."""

    metrics: dict[str, float]
    optimizer_steps: int
    group_is_deviation: tuple[float, ...] = ()
