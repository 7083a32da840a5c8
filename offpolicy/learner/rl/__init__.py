"""The learner's algorithm: one step's training (`train_on`) from a frozen `StepContext`, the optimizer step,
mini- and micro-batches, advantages, losses, and the screening of sampled groups before they train."""

from offpolicy.learner.rl.advantages import (
    ESTIMATORS,
    compute_advantages,
    gae,
    grpo,
    reinforce,
    rloo,
    token_rewards,
)
from offpolicy.learner.rl.context import StepContext, StepResult
from offpolicy.learner.rl.losses import (
    ClipConfig,
    PolicyLoss,
    aggregate_loss,
    compute_policy_loss,
    value_loss,
)
from offpolicy.learner.rl.screening import ModelLimits, Rejection, field_label, screen
from offpolicy.learner.rl.step import advantages, train_on
from offpolicy.learner.rl.update import optimizer_step

__all__ = [
    "ESTIMATORS",
    "ClipConfig",
    "ModelLimits",
    "PolicyLoss",
    "Rejection",
    "StepContext",
    "StepResult",
    "advantages",
    "aggregate_loss",
    "compute_advantages",
    "compute_policy_loss",
    "field_label",
    "gae",
    "grpo",
    "optimizer_step",
    "reinforce",
    "rloo",
    "screen",
    "token_rewards",
    "train_on",
    "value_loss",
]
