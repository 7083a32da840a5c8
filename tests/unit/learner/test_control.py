"""The staleness controller (learner/control/) against a recording switch and a scripted clock: each rule
moves the bound the way ControlConfig says, never past the user's limits, and falls back or switches off
as documented; the actor capacity ratio follows the learner's wait and the actors' supply."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.control import ESS_KEY, MASK_KEYS, StalenessControl
from offpolicy.learner.metrics import LearnerMetrics


@dataclass
class Switch:
    """`ConfigSwitch`'s part the controller uses: the given config, and each bound it was told."""

    given: LearnerConfig
    bounds: list[int | None] = field(default_factory=list)

    def set_staleness(self, bound: int | None) -> None:
        self.bounds.append(bound)


@dataclass
class Stats:
    inserted_total: int = 0
    dropped_total: dict = field(default_factory=dict)
    evicted_total: dict = field(default_factory=dict)
    fill_ratio: float = 0.1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def config(mode: str = "auto", given: int | None = 4, **control) -> LearnerConfig:
    return LearnerConfig(
        model_path="/m", buffer={"max_staleness": given}, control={"mode": mode, "window": 2, **control}
    )


class Run:
    """A controller driven step by step: `step(wait_s, busy_s, ess, masked)` is one learner step."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.clock, self.stats = Clock(), Stats()
        self.metrics = LearnerMetrics(CollectorRegistry())
        self.control = StalenessControl(self.metrics, self.clock)
        self.switch = Switch(cfg)
        self.steps = 0
        self.changes: list = []

    def step(self, wait_s: float = 0.0, busy_s: float = 1.0, ess: float | None = 0.9, masked=None, groups=8):
        change = self.control.decide(self.switch, self.steps, lambda: self.stats)
        if change is not None:
            self.changes.append(change)
        self.clock.now += wait_s
        self.control.fed()
        self.clock.now += busy_s
        metrics = {} if ess is None else {ESS_KEY: ess}
        if masked is not None:
            metrics[MASK_KEYS[0]] = masked
        out = self.control.trained(metrics, groups)
        self.steps += 1
        return out

    @property
    def reasons(self) -> list[str]:
        return [c.reason for c in self.changes]


def test_fixed_never_sets_a_bound() -> None:
    run = Run(config("fixed"))
    for _ in range(12):
        run.step(wait_s=5.0, ess=0.01)  # what would move an `auto` bound both ways
    assert run.switch.bounds == [] and run.control.state == "fixed"
    assert run.control.status(4)["staleness_bound"] == 4


def test_auto_starts_from_the_loosest_bound_whatever_the_given_one() -> None:
    for given in (40, 2, None):
        run = Run(config(given=given, max_staleness=8))
        run.step()
        assert run.switch.bounds == [8] and run.reasons == ["start"]


def test_low_ess_cuts_the_bound_down_to_the_minimum() -> None:
    run = Run(config(max_staleness=8, min_staleness=2, ess_floor=0.5))
    for _ in range(12):
        run.step(ess=0.2)
    assert run.switch.bounds == [8, 3, 2]  # 8 x 0.2 / 0.5 = 3.2: past halving; then held at the minimum
    assert run.reasons == ["start", "ess_below_floor", "ess_below_floor"]
    assert "ESS 0.200 (floor 0.5)" in run.changes[1].detail
    mild = Run(config(max_staleness=8, ess_floor=0.5))
    for _ in range(3):
        mild.step(ess=0.45)
    assert mild.switch.bounds == [8, 4]  # just under the floor: halved all the same


def test_a_bound_far_too_loose_comes_down_in_one_judgement() -> None:
    """A masked share 6x its ceiling cuts 16 to 2 at once, not 16, 8, 4, 2 over three windows (the case of
    benchmarks/control.py --correction decoupled_geo_rs_token_tis)."""
    run = Run(config(max_staleness=16, masked_ceiling=0.1))
    for _ in range(3):
        run.step(ess=None, masked=0.6)
    assert run.switch.bounds == [16, 2] and run.reasons[-1] == "masked_above_ceiling"


def test_a_high_masked_share_halves_the_bound() -> None:
    run = Run(config(max_staleness=8, masked_ceiling=0.3))
    for _ in range(3):
        run.step(ess=None, masked=0.6)
    assert run.switch.bounds == [8, 4] and run.reasons[-1] == "masked_above_ceiling"


def test_waiting_raises_the_bound_only_while_the_correction_is_healthy() -> None:
    run = Run(config(max_staleness=12, wait_ceiling=0.2, ess_floor=0.5))
    for _ in range(5):
        run.step(ess=0.3)  # unhealthy: 12 -> 6 -> 3
    for _ in range(8):
        run.step(wait_s=1.0, busy_s=1.0, ess=0.9)  # healthy, waits half its time
    assert run.switch.bounds == [12, 6, 3, 6, 12]  # doubled (at least +1), capped at max_staleness
    assert run.reasons[3:] == ["learner_waiting"] * 2
    assert [c.step for c in run.changes] == [0, 2, 4, 6, 8]  # two changes at least `window` steps apart
    zero = Run(config(min_staleness=0, max_staleness=1, ess_floor=0.5))
    for _ in range(3):
        zero.step(ess=0.3)
    for _ in range(2):
        zero.step(wait_s=1.0)
    assert zero.switch.bounds == [1, 0, 1]  # at least +1 from 0
    sick = Run(config(max_staleness=2, wait_ceiling=0.2, ess_floor=0.5))
    for _ in range(5):
        sick.step(wait_s=1.0, ess=0.3)  # waiting, but the correction is failing: the bound never rises
    assert sick.switch.bounds == [2, 1]


def test_the_bound_is_judged_on_a_moving_window_so_a_change_is_seen_within_window_steps() -> None:
    run = Run(config(max_staleness=8, window=4, wait_ceiling=0.2, ess_floor=0.5))
    for _ in range(4):
        run.step(ess=0.3)  # steps 0-3 unhealthy: 8 -> 4 at the boundary after step 3
    for _ in range(5):
        run.step()  # steps 4-8 healthy and fed
    for _ in range(3):
        run.step(wait_s=1.0)  # from step 9 on the learner waits half its time
    # the boundary after step 10 judges steps 7-10 (two of them waiting: 2 s of 6): up at once, not at the
    # end of the block 8-11
    assert [(c.step, c.reason) for c in run.changes] == [
        (0, "start"),
        (4, "ess_below_floor"),
        (11, "learner_waiting"),
    ]


def test_a_healthy_fed_learner_keeps_its_bound() -> None:
    run = Run(config(max_staleness=5, wait_ceiling=0.2))
    for _ in range(12):
        run.step(wait_s=0.0, ess=0.6)
    for _ in range(6):
        run.step(wait_s=0.2, busy_s=1.0)  # 17 % wait: under the ceiling
    assert run.switch.bounds == [5] and run.reasons == ["start"]


def test_no_ess_and_no_mask_falls_back_to_the_given_bound_until_they_come_back() -> None:
    run = Run(config(max_staleness=3))
    for _ in range(3):
        run.step(ess=None)
    assert run.switch.bounds == [3, None] and run.control.state == "fallback"
    assert run.reasons == ["start", "missing_metrics"]
    assert run.metrics.control_auto._value.get() == 0
    for _ in range(2):
        run.step(ess=None)
    assert run.switch.bounds == [3, None]  # said once
    for _ in range(3):
        run.step(ess=0.9)
    assert run.switch.bounds == [3, None, 3] and run.control.state == "auto"


def test_a_patch_to_fixed_restores_the_given_bound_at_the_next_boundary() -> None:
    run = Run(config(given=8, max_staleness=8, ess_floor=0.5))
    for _ in range(3):
        run.step(ess=0.3)
    assert run.switch.bounds == [8, 4]
    run.switch.given = config("fixed", given=8)
    run.step()
    assert run.switch.bounds == [8, 4, None] and run.reasons[-1] == "mode_fixed"
    assert run.metrics.control_auto._value.get() == 0
    assert run.control.status(8)["staleness_bound"] == 8


def test_new_limits_clamp_the_bound_at_once() -> None:
    run = Run(config(given=8))
    run.step()
    run.switch.given = config(given=8, max_staleness=3)
    run.step()
    assert run.switch.bounds == [16, 3] and run.reasons[-1] == "limits"


@pytest.mark.parametrize("seed", range(5))
def test_any_inputs_keep_the_bound_within_the_limits(seed: int) -> None:
    rng = random.Random(seed)
    run = Run(config(given=rng.randint(0, 50), min_staleness=2, max_staleness=7, window=1))
    for _ in range(300):
        run.step(
            wait_s=rng.choice([0.0, 0.01, 5.0]),
            busy_s=rng.choice([0.0, 0.5, 1.0]),
            ess=rng.choice([None, 0.0, 0.4, 1.0, float("nan")]),
            masked=rng.choice([None, 0.0, 0.9]),
        )
        if rng.random() < 0.02:  # a PATCH flips the mode now and then
            mode = "fixed" if run.switch.given.control.mode == "auto" else "auto"
            run.switch.given = config(mode, given=5, min_staleness=2, max_staleness=7, window=1)
    assert len(run.switch.bounds) > 10
    assert all(b is None or 2 <= b <= 7 for b in run.switch.bounds)


def test_the_capacity_ratio_follows_the_wait_and_the_supply() -> None:
    run = Run(config("fixed", window=1, capacity_max_ratio=3.0))  # a step is judged at the next boundary
    run.step()
    run.step(wait_s=1.0)  # the first judgement sets the supply's baseline
    run.stats.inserted_total += 2
    run.step()
    # it waited half its time, trains 8 groups/s when fed, the actors added 2 in 2 s: 8x, capped at 3
    assert run.control.capacity.ratio == 3.0
    assert run.metrics.actor_capacity_ratio._value.get() == 3.0
    assert run.control.judged["demand_gps"] == 8.0 and run.control.judged["supply_gps"] == 1.0
    run.stats.inserted_total += 32
    run.step(wait_s=3.0)
    # fed, while the actors added 32 groups/s: a quarter of them would do, the step down capped at half
    assert run.control.capacity.ratio == 0.5
    run.stats.fill_ratio, run.stats.dropped_total["stale"] = 0.95, 34
    run.step()
    # waiting, no usable insert (all dropped stale), but the buffer 95 % full: more actors would not help
    assert run.control.judged["wait_share"] == 0.75 and run.control.capacity.ratio == 1.0
    run.stats.fill_ratio = 0.5
    run.step()
    assert run.control.capacity.ratio == 1.0  # fed, no usable supply measured: holds at 1
