"""The learner's control of its own off-policyness (`control` of the config; learner/config/control.py):
the staleness bound it trains with, and the actor capacity it asks for.

`StalenessControl` is the leader's. Each applied step it is told when the step's groups were in hand
(`fed`) and when the update was applied (`trained`, with the step's metrics): the learner's wait for data
is the time from one step's end to the next step's groups, its work the time from those groups to the
update. At each step boundary (`decide`), with `control.mode: auto`, it judges the steps trained under the
current bound, once `window` of them are in: the mean IS effective sample size and masked-token share of
the rollout correction (verl's `rollout_corr/rollout_is_eff_sample_size`, `rollout_rs_masked_fraction` and
`rollout_is_veto_fraction`) and the share of the learner's time spent waiting. The rules are
`ControlConfig`'s; a new bound reaches the buffer through `ConfigSwitch.set_staleness` (the same
reconfiguration as a PATCH of `buffer.max_staleness`, at the same step boundary), so leases and
acknowledgements are untouched: no group is lost or trained twice whatever the controller does. Every
change is logged with its reason, counted (`offpolicy_learner_control_changes_total{reason}`), kept for
`/v1/status` and `/v1/config/history`, and shown by the gauge `offpolicy_learner_max_staleness_steps`.

`fixed` (the default), or a PATCH back to it, leaves `buffer.max_staleness` as given; so does a correction
that reports neither IS weights nor a mask (nothing to judge by: `fallback`, said in the status).

The actor capacity ratio is judged on the same windows, in every mode (learner/control/capacity.py).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from offpolicy.config.base import MAX_ATTEMPTS
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.control import ControlConfig
from offpolicy.learner.control.capacity import Capacity, Sample, Supply

log = logging.getLogger(__name__)

ESS_KEY = "rollout_corr/rollout_is_eff_sample_size"
MASK_KEYS = ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_veto_fraction")
KEEP_CHANGES = 1000
"""Changes kept for `/v1/config/history` (the oldest go first); `/v1/status` shows the last 20."""
Reason = Literal[
    "start", "mode_fixed", "limits", "ess_below_floor", "masked_above_ceiling", "learner_waiting",
    "missing_metrics",
]  # fmt: skip
REASONS: tuple[str, ...] = Reason.__args__  # type: ignore[attr-defined]


class Bounded(Protocol):
    """What the controller sets: `ConfigSwitch` (learner/reconfigure.py)."""

    @property
    def given(self) -> LearnerConfig: ...
    def set_staleness(self, bound: int | None) -> None: ...


class ControlMetrics(Protocol):
    """The gauges and counter it moves: `LearnerMetrics`' (learner/metrics.py)."""

    control_auto: Any
    control_changes: Any
    wait_share: Any
    actor_capacity_ratio: Any


@dataclass(frozen=True, slots=True)
class Change:
    """One change of the staleness bound (None = `buffer.max_staleness` as given)."""

    step: int
    """Learner steps completed at the boundary where it took effect."""
    at: float
    """Unix seconds."""
    old: int | None
    new: int | None
    reason: str
    detail: str


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


class StalenessControl:
    """The leader's controller (module docstring). `clock` (monotonic seconds) is an attribute a
    simulation may replace (benchmarks/control.py runs the learner on a virtual clock)."""

    def __init__(self, metrics: ControlMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics, self.clock = metrics, clock
        for reason in REASONS:  # every series from the start, at 0
            metrics.control_changes.labels(reason=reason)
        self.bound: int | None = None
        """The bound `auto` set (None: the given `buffer.max_staleness` applies)."""
        self.state: Literal["fixed", "auto", "fallback"] = "fixed"
        self.changes: deque[Change] = deque(maxlen=KEEP_CHANGES)
        self.changes_total = 0
        self.capacity = Capacity(metrics.actor_capacity_ratio)
        self.judged: dict[str, float | None] = {}
        """The last decision's inputs: ess, masked, wait_share, demand_gps, supply_gps."""
        self._samples: deque[Sample] = deque(maxlen=MAX_ATTEMPTS)  # the steps since the last change
        self._unjudged: list[Sample] = []  # the steps since the capacity ratio was last judged
        self._done_at: float | None = None  # the last applied step's end
        self._fed_at: float | None = None  # this step's groups in hand
        self._wait_s = 0.0

    # --- what the learner tells it

    def fed(self) -> None:
        """The step's groups are in hand: the wait since the last step's end ends here."""
        now = self.clock()
        self._wait_s = 0.0 if self._done_at is None else max(0.0, now - self._done_at)
        self._fed_at = now

    def trained(self, metrics: Mapping[str, float], groups: int) -> dict[str, float]:
        """The step's update is applied (`metrics`: its step metrics): record it; returns the keys the
        step's metrics line gets (`control/staleness_bound`, `control/wait_s`, `control/busy_s`)."""
        now = self.clock()
        busy = 0.0 if self._fed_at is None else max(0.0, now - self._fed_at)
        masks = [metrics[k] for k in MASK_KEYS if k in metrics and math.isfinite(metrics[k])]
        ess = metrics.get(ESS_KEY)
        sample = Sample(
            ess=ess if ess is not None and math.isfinite(ess) else None,
            masked=min(1.0, sum(masks)) if masks else None,
            wait_s=self._wait_s,
            busy_s=busy,
            groups=groups,
        )
        self._samples.append(sample)
        self._unjudged.append(sample)
        self._done_at, self._fed_at = now, None
        out = {"control/wait_s": self._wait_s, "control/busy_s": busy}
        if self.bound is not None:
            out["control/staleness_bound"] = float(self.bound)
        return out

    # --- the step boundary

    def decide(self, switch: Bounded, step: int, supply: Callable[[], Supply] | None = None) -> Change | None:
        """At the boundary after `step` learner steps: the bound for the next step (module docstring);
        `supply()` reads the buffer's counters (once per `window` steps, for the capacity ratio). Returns
        the change made, if any.

        The bound is judged at every boundary on the last `window` steps trained under it (a moving
        window), once `window` steps have passed since it last changed: a change of conditions is seen
        within `window` steps, and two changes are at least `window` steps apart."""
        cfg = switch.given.control
        if len(self._unjudged) >= cfg.window:  # the capacity ratio, in every mode, on disjoint windows
            window, self._unjudged = self._unjudged[-cfg.window :], []
            share = _wait_share(window)
            self.metrics.wait_share.set(share)
            self.judged["wait_share"] = share  # the bound's judgement (auto) says it on its own window
            if supply is not None:
                self.capacity.judge(cfg, window, share, supply(), self.clock())
                self.judged |= self.capacity.judged
        if cfg.mode == "fixed":
            if self.state != "fixed":
                self.state = "fixed"
                self.metrics.control_auto.set(0)
                return self._set(switch, step, None, "mode_fixed", "control.mode set to fixed")
            return None
        if self.state == "fixed":
            self.state = "auto"
            self.metrics.control_auto.set(1)
            return self._set(
                switch, step, cfg.max_staleness, "start",
                f"control.mode auto: from the loosest bound, within [{cfg.min_staleness}, "
                f"{cfg.max_staleness}] (buffer.max_staleness {switch.given.buffer.max_staleness} is the "
                "fallback's)",
            )  # fmt: skip
        if self.bound is not None and self.bound != _clamp(self.bound, cfg):
            return self._set(
                switch, step, _clamp(self.bound, cfg), "limits",
                f"control limits now [{cfg.min_staleness}, {cfg.max_staleness}]",
            )  # fmt: skip
        if len(self._samples) < cfg.window:
            return None
        return self._judge(switch, step, cfg, list(self._samples)[-cfg.window :])

    def _judge(self, switch: Bounded, step: int, cfg: ControlConfig, window: list[Sample]) -> Change | None:
        ess = _mean([s.ess for s in window if s.ess is not None])
        masked = _mean([s.masked for s in window if s.masked is not None])
        wait_share = _wait_share(window)
        self.metrics.wait_share.set(wait_share)
        self.judged |= {"ess": ess, "masked": masked, "wait_share": wait_share}
        if ess is None and masked is None:  # nothing to judge the correction by
            if self.state == "fallback":
                return None
            self.state = "fallback"
            self.metrics.control_auto.set(0)
            return self._set(
                switch, step, None, "missing_metrics",
                f"the rollout correction reports neither {ESS_KEY} nor a mask: back to "
                f"buffer.max_staleness {switch.given.buffer.max_staleness} (fixed) until it does",
            )  # fmt: skip
        if self.state == "fallback":  # the metrics are back: start again from the given bound
            self.state = "auto"
            self.metrics.control_auto.set(1)
            return self._set(switch, step, cfg.max_staleness, "start", "the correction's metrics are back")
        bound = self.bound if self.bound is not None else cfg.max_staleness
        said = (
            f"ESS {_fmt(ess)} (floor {cfg.ess_floor}), masked {_fmt(masked)} (ceiling {cfg.masked_ceiling}), "
        )
        said += f"waited {wait_share:.0%} (ceiling {cfg.wait_ceiling:.0%}) over {len(window)} steps"
        if ess is not None and ess < cfg.ess_floor:
            return self._set(
                switch, step, _tightened(bound, ess / cfg.ess_floor, cfg), "ess_below_floor", said
            )
        if masked is not None and masked > cfg.masked_ceiling:
            new = _tightened(bound, cfg.masked_ceiling / masked, cfg)
            return self._set(switch, step, new, "masked_above_ceiling", said)
        if wait_share > cfg.wait_ceiling:
            return self._set(switch, step, _clamp(max(bound + 1, 2 * bound), cfg), "learner_waiting", said)
        return None  # healthy and fed: the bound holds

    def _set(self, switch: Bounded, step: int, new: int | None, reason: str, detail: str) -> Change | None:
        old, self.bound = self.bound, new
        self._samples.clear()
        if old == new and reason not in ("start", "missing_metrics"):
            return None  # already at the limit
        switch.set_staleness(new)
        change = Change(step, time.time(), old, new, reason, detail)
        self.changes.append(change)
        self.changes_total += 1
        self.metrics.control_changes.labels(reason=reason).inc()
        log.info("staleness bound %s -> %s at step %d (%s): %s", old, new, step, reason, detail)
        return change

    def status(self, given: int | None) -> dict[str, Any]:
        """`/v1/status` `control`: mode and state, the bound in force, the last decision's inputs, the
        capacity ratio and the last 20 changes (`given`: the config's `buffer.max_staleness`)."""
        return {
            "state": self.state,
            "staleness_bound": self.bound if self.bound is not None else given,
            "given_max_staleness": given,
            "judged": dict(self.judged),
            "actor_capacity_ratio": self.capacity.ratio,
            "changes_total": self.changes_total,
            "changes": [asdict(c) for c in list(self.changes)[-20:]],
        }

    def history(self) -> list[dict[str, Any]]:
        """Every kept change, oldest first (`/v1/config/history` `control`)."""
        return [asdict(c) for c in self.changes]


def _wait_share(window: list[Sample]) -> float:
    """The share of a window's time the learner spent waiting for data."""
    waited = sum(s.wait_s for s in window)
    spent = waited + sum(s.busy_s for s in window)
    return waited / spent if spent > 0 else 0.0


def _tightened(bound: int, health: float, cfg: ControlConfig) -> int:
    """The bound after an unhealthy window: halved, or cut in proportion to how far the figure is past its
    target (`health`: ESS / floor, or ceiling / masked share, < 1) when that is further, so that a bound
    far too loose comes down in one judgement instead of several halvings (each a window of damage)."""
    return _clamp(min(bound // 2, math.floor(bound * health)), cfg)


def _clamp(bound: int, cfg: ControlConfig) -> int:
    return min(max(bound, cfg.min_staleness), cfg.max_staleness)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
