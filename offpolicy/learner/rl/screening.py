"""Screen sampled groups against the model before training: a group the learner cannot train is set aside.

The buffer already rejects malformed records (codec and `buffer/validation.py`); what only the learner
knows is its model: a token id past the vocabulary, a prompt + response longer than the model's context,
and the things `collate` cannot pad (an empty completion, a log-prob count that differs from the token
count, greedy sampling, whose behaviour log-probs are not a distribution's). `screen` splits a batch into
trainable groups and rejections, each naming the field that failed (`dropped:invalid:<field>` in the
buffer), so one bad group never ends the loop and its neighbours still train.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from offpolicy.buffer.types import TrajectoryGroup


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why one group cannot be trained: the failing field's path and a message with the values."""

    group: TrajectoryGroup
    field: str
    reason: str


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the model accepts: ids in [0, vocab_size), at most `max_positions` tokens per sequence; with
    `routed` ((sparse layers, top-k): `moe.routing_replay: rollout`) every trajectory's `routed_experts` of
    that shape, a group without them refused rather than trained unreplayed."""

    vocab_size: int
    max_positions: int
    routed: tuple[int, int] | None = None
    images: bool = False  # a vision-language policy: groups may show images (else one that does is refused)


def _check(group: TrajectoryGroup, limits: ModelLimits) -> tuple[str, str] | None:
    """(field, reason) of the first problem of `group`, or None."""
    if group.sampling.temperature <= 0:
        return "sampling.temperature", f"temperature {group.sampling.temperature} has no sampling log-probs"
    if group.images and not limits.images:
        return "images", f"shows {len(group.images)} image(s); the policy is not a vision-language model"
    prompt = np.asarray(group.prompt_ids)
    if prompt.size == 0:  # the first response token would have no state to predict it from
        return "prompt_ids", "empty prompt: the first response token has no context"
    if prompt.min() < 0 or prompt.max() >= limits.vocab_size:
        return (
            "prompt_ids",
            f"token ids must lie in [0, {limits.vocab_size}); got {prompt.min()}..{prompt.max()}",
        )
    for i, t in enumerate(group.trajectories):
        ids = np.asarray(t.response_ids)
        where = f"trajectories[{i}]"
        if ids.size == 0:
            return f"{where}.response_ids", "empty completion: nothing to train on"
        if len(t.behavior_logprobs) != ids.size:
            return f"{where}.behavior_logprobs", f"{len(t.behavior_logprobs)} log-probs for {ids.size} tokens"
        if ids.min() < 0 or ids.max() >= limits.vocab_size:
            return (
                f"{where}.response_ids",
                f"token ids must lie in [0, {limits.vocab_size}); got {ids.min()}..{ids.max()}",
            )
        if prompt.size + ids.size > limits.max_positions:
            total = f"prompt {prompt.size} + response {ids.size} tokens"
            return f"{where}.response_ids", f"{total} exceed the model's {limits.max_positions} positions"
        if limits.routed is not None:
            if t.routed_experts is None:
                return (
                    f"{where}.routed_experts",
                    "none: moe.routing_replay=rollout replays the rollout's experts",
                )
            if tuple(t.routed_experts.shape[1:]) != limits.routed:
                got = tuple(t.routed_experts.shape[1:])
                return f"{where}.routed_experts", f"(layers, top_k) {got}, the policy routes {limits.routed}"
    return None


def field_label(field: str) -> str:
    """A field path without list indices (`trajectories[3].response_ids` -> `trajectories.response_ids`):
    a bounded metric label."""
    return re.sub(r"\[\d+\]", "", field)


def screen(
    groups: Sequence[TrajectoryGroup], limits: ModelLimits
) -> tuple[list[TrajectoryGroup], list[Rejection]]:
    """Split `groups` into those the model can train on and the rejections (order kept)."""
    good, bad = [], []
    for group in groups:
        problem = _check(group, limits)
        if problem is None:
            good.append(group)
        else:
            bad.append(Rejection(group, *problem))
    return good, bad
