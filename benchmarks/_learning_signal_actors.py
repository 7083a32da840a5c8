"""The actors of benchmarks/learning_signal.py: what each (arm, seed) run generates, step by step.

At step t the current policy generates the step's batch (`step_batch`: the same prompts and sampling noise
at step t in every arm): its learnable groups' reward is the run's reward curve. The learner, at policy
version v, trains what an actor pool `eta` versions behind delivers (`StaleActors.behind`,
benchmarks/stale_actors.py): the same prompts with the same noise sampled by policy max(v - eta, 0) and
stamped with that version, and the dynamic arm's refills (`refill`) from that policy too. Lagging in
versions, not steps: a step the dynamic arm skips (every group dropped, no optimizer step) leaves the
pool's policy where it was, as it would an asynchronous pool's. At eta 0 (the synchronous loop) the
trained batch is the current policy's batch itself.

Flat prompts (odd-numbered) have their rewards zeroed; under `prioritized` the producer stamps the
learner's priority function at staleness 0 (the version that generated the group).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from offpolicy.buffer.types import TrajectoryGroup
from offpolicy.learner.rl.priorities import priority
from stale_actors import StaleActors
from staleness import make_groups

if TYPE_CHECKING:
    from learning_signal import Setup
    from offpolicy.learner.trainer import Learner

DECAY = 0.9
"""`priorities.staleness_decay` of the prioritized arm (and of its producer)."""


def flat_prompt(prompt: dict) -> bool:
    """Odd-numbered prompts are flat: their verifier never accepts."""
    return int(prompt["id"].rsplit("-", 1)[-1]) % 2 == 1


def generate(
    model, tok, prompts: list[dict], version: int, setup: Setup, gen: torch.Generator, arm: str
) -> list[TrajectoryGroup]:
    """Groups of `model` (policy `version`, stamped on them); flat prompts' rewards zeroed; under
    `prioritized` the producer stamps the learner's priority function at staleness 0."""
    groups = make_groups(model, tok, prompts, version, setup, gen)
    out = []
    for p, g in zip(prompts, groups, strict=True):
        if flat_prompt(p):
            g = replace(g, trajectories=[replace(t, reward=0.0) for t in g.trajectories])
        if arm == "prioritized":
            g = replace(g, priority=priority(g, version, DECAY))
        out.append(g)
    return out


class ArmActors:
    """One run's generation: `steps` batches of `setup.groups_per_step` groups and the refills, `setup.eta`
    policy versions behind `learner` (whose model generates the current policy's batches)."""

    def __init__(self, learner: Learner, tok, prompts: list[dict], setup: Setup, arm: str, seed: int,
                 steps: int) -> None:  # fmt: skip
        self.learner, self.tok, self.prompts, self.setup, self.arm = learner, tok, prompts, setup, arm
        self.seed = seed
        self.table = np.random.default_rng(seed).integers(0, len(prompts), (steps, setup.groups_per_step))
        self.gen, self.refill_gen = torch.Generator(), torch.Generator()
        self.refill_gen.manual_seed(7_919 * seed + 17)
        self.refill_rng = np.random.default_rng(seed + 1_000)
        self.pool = StaleActors(learner.model, setup.eta)

    def _batch(self, t: int, picked: list[dict], model, version: int) -> list[TrajectoryGroup]:
        self.gen.manual_seed(1_000_003 * self.seed + 1_009 * t)
        with torch.no_grad():
            return generate(model, self.tok, picked, version, self.setup, self.gen, self.arm)

    def step_batch(self, t: int) -> tuple[list[dict], list[TrajectoryGroup], list[TrajectoryGroup]]:
        """(prompts, fresh, train) at step t: the prompts, the current policy's batch (the reward curve),
        and the batch the learner trains now: the same prompts and noise from the policy eta versions
        behind (at eta 0 `fresh` itself)."""
        picked = [self.prompts[int(i)] for i in self.table[t]]
        live, version = self.learner.model, self.learner.version
        self.pool.record(version)
        fresh = self._batch(t, picked, live, version)
        stale, stale_version = self.pool.behind(version)
        return picked, fresh, fresh if stale is live else self._batch(t, picked, stale, stale_version)

    def refill(self, n: int) -> list[TrajectoryGroup]:
        """`n` fresh groups of random prompts from the policy eta versions behind the learner."""
        picked = [self.prompts[int(i)] for i in self.refill_rng.integers(0, len(self.prompts), n)]
        model, version = self.pool.behind(self.learner.version)
        return generate(model, self.tok, picked, version, self.setup, self.refill_gen, self.arm)
