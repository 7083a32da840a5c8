"""The learner's dynamic sampling settings (`screening` of learner/config): which sampled groups are not
trained, and how the batch is kept full (learner/rl/dynamic_sampling.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from offpolicy.config.base import MAX_ATTEMPTS, MAX_SEQ_TOKENS, ConfigModel


class ScreeningConfig(ConfigModel):
    """DAPO's dynamic sampling and overlong handling, in async mode; off by default (every group trains)."""

    drop_zero_variance: bool = False
    """Drop a group whose completions' rewards (after `overlong: punish`) all lie within
    `zero_variance_eps` of each other: under a group-relative estimator (grpo, rloo, reinforce) its
    advantages are zero everywhere, so it costs a step's compute and teaches nothing. Dropped groups are
    acknowledged (consumed, never trained), counted by reason (`groups_dropped_total`)."""
    zero_variance_eps: float = Field(1e-6, ge=0.0)
    """The reward spread (max - min) at or below which a group counts as zero-variance."""
    overlong: Literal["off", "filter", "punish"] = "off"
    """Truncated completions (`finish_reason: length`). `filter`: no loss on them (they still count in
    their group's baseline); a group whose completions are all truncated is dropped (`all_truncated`).
    `punish`: DAPO's soft overlong punishment added to the reward: 0 up to `max_tokens -
    overlong_buffer_tokens` response tokens, then falling linearly to `-overlong_penalty` at the group's
    `sampling.max_tokens` (and below it past that)."""
    overlong_buffer_tokens: int = Field(512, ge=1, le=MAX_SEQ_TOKENS)
    """The punishment's buffer: the last this many tokens before `max_tokens`."""
    overlong_penalty: float = Field(1.0, ge=0.0)
    """The punishment at `max_tokens` (DAPO: 1.0)."""
    max_refill_rounds: int = Field(4, ge=0, le=MAX_ATTEMPTS)
    """Extra leases per step to replace dropped groups, so that a step trains as many groups as it
    sampled trainable ones (up to `groups_per_step`); after these rounds (or an empty one) the step trains
    what it has and says so (`screening/short` in its metrics)."""
    refill_timeout_s: float = Field(1.0, ge=0.0, le=600.0)
    """How long one refill lease waits for groups (the first lease waits `sample_timeout_s`)."""
