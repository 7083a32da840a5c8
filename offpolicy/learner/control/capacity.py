"""The actor capacity the learner asks for (`offpolicy_learner_actor_capacity_ratio`: the autoscaler's input,
k8s overlay `gpu`; compose: the log line), judged on the staleness controller's windows in every mode.

The ratio is the groups per second the learner would train if it never waited (the window's groups over
its training time) over the groups per second the actors put into the buffer that it could use (inserts
less stale drops and evictions of unsampled groups, between two judgements); at least 1 while the learner
waits more than `control.wait_ceiling`, at most 1 while it does not or the buffer is 90 % full (more actors
would only fill it), clamped to `control.capacity_min_ratio`..`capacity_max_ratio`. An autoscaler that
multiplies the actors by it (the HPA's Value target 1: desired = ceil(current x ratio)) brings supply to
demand.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

from offpolicy.learner.config.control import ControlConfig

log = logging.getLogger(__name__)

FULL_FILL = 0.9
"""Buffer fill at and above which more actors are never asked for."""
ADVICE_STEP = 1.25
"""The log line's advice is said again when the ratio moved by more than this factor since it last was."""


class Supply(Protocol):
    """What a judgement reads of the buffer: `ReplayBuffer.stats()`' fields."""

    inserted_total: int
    dropped_total: dict[str, int]
    evicted_total: dict[str, int]
    fill_ratio: float


@dataclass(frozen=True, slots=True)
class Sample:
    """One applied learner step as the controller saw it."""

    ess: float | None
    masked: float | None
    wait_s: float
    busy_s: float
    groups: int


class Capacity:
    """The ratio (module docstring), its gauge, and the advice logged when it moves."""

    def __init__(self, gauge: Any) -> None:
        self.gauge = gauge
        self.ratio = 1.0
        self.judged: dict[str, float] = {}
        """The last judgement's `demand_gps` and `supply_gps`."""
        self._before: tuple[float, int] | None = None  # (clock, usable inserts) at the last judgement
        self._advised = 1.0
        gauge.set(1.0)

    def judge(
        self, cfg: ControlConfig, window: list[Sample], wait_share: float, stats: Supply, now: float
    ) -> None:
        """The ratio from this window and the buffer's counters read `now` (the first sets the baseline)."""
        usable = stats.inserted_total - stats.dropped_total.get("stale", 0)
        usable -= stats.evicted_total.get("evicted_unsampled", 0)
        usable -= stats.dropped_total.get("evicted_unsampled", 0)
        before, self._before = self._before, (now, usable)
        busy = sum(s.busy_s for s in window)
        if before is None or now <= before[0] or busy <= 0:
            return
        demand = sum(s.groups for s in window) / busy
        rate = max(0, usable - before[1]) / (now - before[0])
        ratio = demand / rate if rate > 0 else cfg.capacity_max_ratio
        ratio = max(ratio, 1.0) if wait_share > cfg.wait_ceiling else min(ratio, 1.0)
        if stats.fill_ratio >= FULL_FILL:
            ratio = min(ratio, 1.0)
        self.ratio = min(max(ratio, cfg.capacity_min_ratio), cfg.capacity_max_ratio)
        self.judged = {"demand_gps": demand, "supply_gps": rate}
        self.gauge.set(self.ratio)
        if abs(math.log(self.ratio / self._advised)) > math.log(ADVICE_STEP):
            self._advised = self.ratio
            log.info(
                "actor capacity: the learner wants %.2fx the actors it has (it trains %.2f groups/s when "
                "fed, the actors add %.2f usable groups/s, it waited %.0f%% of its time): docker compose up "
                "-d --scale actor=<that many>; the k8s gpu overlay's HPA scales on "
                "offpolicy_learner_actor_capacity_ratio",
                self.ratio, demand, rate, 100 * wait_share,
            )  # fmt: skip
