"""The learner's control of its own off-policyness (`control` of learner/config): `fixed` trains with
`buffer.max_staleness` as given; `auto` sets the staleness bound each step from what the rollout correction
and the learner's wait saw over the last steps (learner/control/)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from offpolicy.config.base import MAX_ATTEMPTS, MAX_COUNT, ConfigModel


class ControlConfig(ConfigModel):
    """The staleness bound's controller and the actor capacity the learner asks for; `fixed` by default.

    In `auto` the bound (policy versions, as `buffer.max_staleness` counts them) starts at `max_staleness`,
    the loosest the user allows (the bound is a safety limit: as loose as the correction's health permits),
    and moves between `min_staleness` and `max_staleness`, judged at every step boundary on the last
    `window` steps trained under the current bound (so at most once per `window` steps, and within
    `window` steps of a change of conditions):

    - down when the correction is unhealthy: the mean IS effective sample size below `ess_floor`, or the
      masked-token share (RS rejections plus vetoes) above `masked_ceiling`; halved, or cut in proportion
      to how far the figure is past its target (bound x ESS / floor, bound x ceiling / masked) when that
      is further;
    - up (doubled, at least +1) when the correction is healthy and the learner waited for data more than
      `wait_ceiling` of its time;
    - else it holds: a healthy correction is the target, so a fed learner keeps the bound it has.

    (benchmarks/control.py measured three earlier versions, kept in its records: one that started from
    `buffer.max_staleness`, rose x1.5 and stepped down by one after two windows fed; one that doubled and
    held; one that judged on a moving window. Each left the learner idle about twice as long as the
    loosest fixed bound on a task where that bound cost no reward.)

    A correction that reports neither IS weights nor a rejection mask gives nothing to judge by: the
    learner falls back to `buffer.max_staleness` and says why (`/v1/status` `control`).

    A change reconfigures the buffer at a step boundary, as a PATCH of `buffer.max_staleness` would: leases
    and acknowledgements are untouched, so no group is lost or trained twice; groups past a tighter bound
    are dropped by the buffer as `stale`, counted."""

    mode: Literal["fixed", "auto"] = "fixed"
    """`fixed`: `buffer.max_staleness` as given. `auto`: the controller sets it, from `max_staleness` (the
    given `buffer.max_staleness` is then the fallback's); one PATCH back to `fixed` restores the given
    bound at the next step boundary."""
    min_staleness: int = Field(1, ge=0, le=MAX_COUNT)
    """Lowest bound `auto` may set, in policy versions."""
    max_staleness: int = Field(16, ge=0, le=MAX_COUNT)
    """Highest bound `auto` may set, in policy versions, and the one it starts from."""
    ess_floor: float = Field(0.5, ge=0.0, le=1.0)
    """Lowest acceptable mean `rollout_corr/rollout_is_eff_sample_size` (verl's normalised ESS, 1 = on
    policy)."""
    masked_ceiling: float = Field(0.3, ge=0.0, le=1.0)
    """Highest acceptable share of response tokens the correction masks (`rollout_rs_masked_fraction` plus
    `rollout_is_veto_fraction`)."""
    wait_ceiling: float = Field(0.2, ge=0.0, le=1.0)
    """Highest acceptable share of the learner's time spent waiting for data (from the end of one step to
    the lease of the next step's groups, over that plus the step's training)."""
    window: int = Field(4, ge=1, le=MAX_ATTEMPTS)
    """Learner steps judged per decision (a moving window), and the least number of steps between two
    changes; the actor capacity ratio is judged once per `window` steps."""
    capacity_min_ratio: float = Field(0.5, gt=0.0, le=1.0)
    """Lowest actor capacity ratio the learner exports (`offpolicy_learner_actor_capacity_ratio`): the
    autoscaler removes at most this share of the actors per decision."""
    capacity_max_ratio: float = Field(2.0, ge=1.0, le=100.0)
    """Highest actor capacity ratio it exports: the autoscaler at most multiplies the actors by this."""

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_staleness > self.max_staleness:
            raise ValueError(
                f"min_staleness={self.min_staleness} is above max_staleness={self.max_staleness}"
            )
        return self
