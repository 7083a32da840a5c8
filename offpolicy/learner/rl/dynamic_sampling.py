"""Dynamic sampling (DAPO, in async mode): sampled groups that teach nothing are not trained, and the step
samples more to keep its batch full.

- `sift` splits screened groups into those to train and those dropped, each with its reason:
  `zero_variance` (`screening.drop_zero_variance`: every completion's reward within `zero_variance_eps`
  of the others, so a group-relative advantage is zero everywhere) and `all_truncated` (`overlong:
  filter` and no completion finished). Under `overlong: punish` the groups come back with DAPO's soft
  overlong punishment added to each completion's reward (`overlong_penalty`), before the variance test.
- `fill` keeps a step's trainable groups at what it sampled: while groups were dropped it leases as many
  more (`more(n)`: the trainer's lease, screened), at most `max_refill_rounds` times, then trains what it
  has. The trainer acknowledges dropped groups like trained ones (their leases are held by the next
  checkpoint: consumed once, never trained, never lost).

`overlong: filter`'s loss mask is applied by `truncated_rows` in the step (rl/step.py), on every rank
from the groups themselves. Everything here runs on the leader before the groups are sent to the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from offpolicy.learner.metrics import DROP_REASONS as DROP_REASONS  # the reasons `Dropped` names

if TYPE_CHECKING:
    from offpolicy.buffer.types import Trajectory, TrajectoryGroup
    from offpolicy.learner.config.screening import ScreeningConfig


@dataclass(frozen=True, slots=True)
class Dropped:
    """A group not trained, and why (one of `DROP_REASONS`)."""

    group: TrajectoryGroup
    reason: str


@dataclass(frozen=True, slots=True)
class Filled:
    """What a step trains after dynamic sampling: its groups, the dropped ones, the refill rounds it took,
    and whether it trains fewer than it sampled (`short`)."""

    groups: list[TrajectoryGroup]
    dropped: list[Dropped]
    rounds: int
    short: bool

    def metrics(self) -> dict[str, float]:
        """Its part of the step's metrics."""
        return {
            "screening/dropped": float(len(self.dropped)),
            "screening/refill_rounds": float(self.rounds),
            "screening/short": float(self.short),
        }


def truncated(t: Trajectory) -> bool:
    """The completion hit its token limit (`finish_reason: length`)."""
    return t.finish_reason == "length"


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of a completion of `length` tokens: 0 up to `max_tokens - buffer`,
    then linear to `-penalty` at `max_tokens`, `-penalty` past it."""
    expected = max_tokens - buffer
    if length <= expected:
        return 0.0
    if length <= max_tokens:
        return penalty * (expected - length) / buffer
    return -penalty


def punished(group: TrajectoryGroup, cfg: ScreeningConfig) -> TrajectoryGroup:
    """`group` with each completion's reward plus its overlong punishment (a copy; the buffer's is kept)."""
    limit = group.sampling.max_tokens
    trajectories = [
        dataclasses.replace(
            t,
            reward=float(t.reward)
            + overlong_penalty(len(t.response_ids), limit, cfg.overlong_buffer_tokens, cfg.overlong_penalty),
        )
        for t in group.trajectories
    ]
    return dataclasses.replace(group, trajectories=trajectories)


def zero_variance(group: TrajectoryGroup, eps: float) -> bool:
    """Every completion's reward within `eps` of the others (a group of one counts as zero-variance)."""
    rewards = [float(t.reward) for t in group.trajectories]
    return max(rewards) - min(rewards) <= eps


def sift(
    groups: Sequence[TrajectoryGroup], cfg: ScreeningConfig
) -> tuple[list[TrajectoryGroup], list[Dropped]]:
    """The groups to train (punished under `overlong: punish`) and the dropped ones (order kept)."""
    keep: list[TrajectoryGroup] = []
    dropped: list[Dropped] = []
    for group in groups:
        if cfg.overlong == "punish":
            group = punished(group, cfg)
        if cfg.overlong == "filter" and all(truncated(t) for t in group.trajectories):
            dropped.append(Dropped(group, "all_truncated"))
        elif cfg.drop_zero_variance and zero_variance(group, cfg.zero_variance_eps):
            dropped.append(Dropped(group, "zero_variance"))
        else:
            keep.append(group)
    return keep, dropped


def fill(
    first: Sequence[TrajectoryGroup],
    cfg: ScreeningConfig,
    more: Callable[[int], list[TrajectoryGroup]],
) -> Filled:
    """Sift `first` (a step's screened groups) and, while groups were dropped, lease replacements with
    `more(n)` (screened; fewer or none when the buffer has no more) until the step has as many trainable
    groups as `first`, at most `max_refill_rounds` times."""
    keep, dropped = sift(first, cfg)
    target, rounds = len(first), 0
    while len(keep) < target and rounds < cfg.max_refill_rounds:
        rounds += 1
        extra = more(target - len(keep))
        if not extra:
            break
        got, lost = sift(extra, cfg)
        keep += got
        dropped += lost
    return Filled(keep, dropped, rounds, short=len(keep) < target)


def truncated_rows(groups: Sequence[TrajectoryGroup]) -> torch.Tensor:
    """(B,) bool in `collate`'s row order: which completions were truncated."""
    return torch.tensor([truncated(t) for g in groups for t in g.trajectories], dtype=torch.bool)
