"""The learner's prioritized replay settings (`priorities` of learner/config): the priority it writes back
to the buffer after training a group, and the importance weights that undo the sampling bias
(learner/rl/priorities.py). The sampler's own exponent is the buffer's `priority_alpha`."""

from __future__ import annotations

from pydantic import Field

from offpolicy.config.base import ConfigModel


class PrioritiesConfig(ConfigModel):
    """Prioritized experience replay (Schaul et al. 2016) kept current by the learner; off by default."""

    update: bool = False
    """Write each trained (or dropped) group's priority back to the buffer, in the same script call as its
    acknowledgement (`delivery: step`: right after the update; `checkpoint`: once the checkpoint is
    durable): `mean |A| over its tokens x staleness_decay^staleness` (learner/rl/priorities.py). Only
    groups that stay in the buffer (`max_times_sampled` > 1 or None) and have a priority (inserted under
    the `prioritized` sampler) take it."""
    staleness_decay: float = Field(0.9, gt=0.0, le=1.0)
    """A group's priority is multiplied by this per policy version of staleness it will have at its next
    sample (the learner's version after the update minus the group's `policy_version`)."""
    beta: float = Field(0.0, ge=0.0, le=1.0)
    """priority_beta: each sampled group's advantages are multiplied by its importance weight
    (N P(i))^-beta / max_j (N P(j))^-beta over the step's groups, P(i) ∝ (priority_i + priority_epsilon)^
    priority_alpha (the buffer's): 1 undoes the `prioritized` sampler's bias fully, 0 = no weights (off).
    Only with the `prioritized` sampler."""
