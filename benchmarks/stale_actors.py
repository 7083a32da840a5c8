"""Actors a fixed `eta` policy versions behind the learner, for the benchmarks that force staleness
(`staleness.py`, `learning_signal.py --eta`): the learner at version t trains only on groups of policy
version t - eta (version 0 while t < eta), as from an asynchronous actor pool that always lags eta steps.

Two ways to get such groups, one object:
- `handoff` (the delay line, staleness.py): the batch the current policy generated at step t waits in a
  FIFO and is handed to the learner at step t + eta; the pool starts with eta batches of the initial
  weights. The generation at step t thus also measures the current policy (the reward curve) for free;
  exact when every step advances the version by one.
- `behind` (snapshots, learning_signal.py): the policy of version v - eta itself, to generate with at any
  time: groups asked for during a step (the dynamic-sampling refills), which a delay line cannot know in
  advance, and a lag counted in versions even across steps that trained nothing. `record` keeps a copy
  of the learner's weights per version, the last eta + 1 only.

At eta 0 both are the identity: `handoff` returns the batch it gets, `behind` the learner's own model, and
no copy is made. Deliberately simplified: the snapshots are whole state-dict copies in the model's own
memory and one deep copy of the model generates from them: right for the tiny CPU model of these
benchmarks; a real pool would reload published weights instead (docs/weight_sync.md).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

import torch

Batch = TypeVar("Batch")


class StaleActors(Generic[Batch]):
    """The pool eta versions behind `model` (the learner's live model, whose version the caller says)."""

    def __init__(self, model: torch.nn.Module, eta: int, initial: Iterable[Batch] | None = None) -> None:
        """`initial` (for `handoff` only): the eta batches the initial weights (version 0) generated before
        step 0, handed to the learner at steps 0 .. eta - 1 (oldest first)."""
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        self.eta, self.model = eta, model
        self._delay: deque[Batch] | None = None if initial is None else deque(initial)
        if self._delay is not None and len(self._delay) != eta:
            raise ValueError(f"{len(self._delay)} initial batches for eta {eta}: need exactly eta")
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._shadow: torch.nn.Module | None = None
        self._loaded: int | None = None

    def handoff(self, fresh: Batch) -> Batch:
        """Queue `fresh` (the current policy's batch of this step); return the batch of eta steps ago."""
        if self._delay is None:
            if self.eta == 0:
                return fresh
            raise ValueError(f"no delay line: StaleActors(model, {self.eta}, initial=<{self.eta} batches>)")
        self._delay.append(fresh)
        return self._delay.popleft()

    def record(self, version: int) -> None:
        """Snapshot the model's weights as policy `version` (call once per version, before its step's
        refills); keeps versions >= version - eta. A no-op at eta 0."""
        if self.eta == 0:
            return
        state = self.model.state_dict()
        self._snapshots[version] = {k: v.detach().clone() for k, v in state.items()}
        for old in [v for v in self._snapshots if v < version - self.eta]:
            del self._snapshots[old]

    def behind(self, version: int) -> tuple[torch.nn.Module, int]:
        """(model, its version): the policy max(version - eta, 0) for a learner at `version` (eta 0: the
        learner's model itself). Its version must have been `record`ed."""
        if self.eta == 0:
            return self.model, version
        stale = max(version - self.eta, 0)
        if stale not in self._snapshots:
            raise KeyError(f"policy version {stale} was not recorded (have {sorted(self._snapshots)})")
        if self._shadow is None:
            self._shadow = copy.deepcopy(self.model).eval()
        if self._loaded != stale:
            self._shadow.load_state_dict(self._snapshots[stale])
            self._loaded = stale
        return self._shadow, stale
