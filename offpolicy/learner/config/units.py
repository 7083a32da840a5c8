"""A learner config's cadences said in both units: a policy version is one optimizer step, a learner step
takes `optimizer_steps_per_step` of them (the start log's and `offpolicy config check`'s `units:` line)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offpolicy.learner.config import LearnerConfig


def units(config: LearnerConfig, eval_every_versions: int | None = None) -> str:
    """The config's cadences in both units: a policy version is one optimizer step, a learner step
    takes `optimizer_steps_per_step` of them; `buffer.max_staleness` (and an actor's
    `eval.every_versions`) count versions, `publish_every` and `checkpoint_every` learner steps. Said at
    start and by `offpolicy config check`."""
    n = config.optimizer_steps_per_step
    mb = config.mini_batch_groups or config.groups_per_step
    parts = [
        f"a policy version is one optimizer step; a learner step takes {n} (ppo_epochs "
        f"{config.ppo_epochs} x groups_per_step {config.groups_per_step} / mini_batch_groups {mb})"
    ]
    s = config.buffer.max_staleness
    parts.append(
        "buffer.max_staleness unbounded"
        if s is None
        else f"buffer.max_staleness {s} versions = {s / n:g} learner step(s)"
    )
    if config.control.mode == "auto":
        lo, hi = config.control.min_staleness, config.control.max_staleness
        parts[-1] += f" at start, then set by control.mode auto within [{lo}, {hi}] versions"
    publish = config.publish.publish_every
    parts.append(f"publish_every {publish} learner step(s) = {publish * n} versions")
    if config.checkpoint.checkpoint_every is not None:
        every = config.checkpoint.checkpoint_every
        parts.append(f"checkpoint_every {every} learner step(s) = {every * n} versions")
    if eval_every_versions is not None:
        parts.append(
            f"eval.every_versions {eval_every_versions} = {eval_every_versions / n:g} learner step(s)"
        )
    return "; ".join(parts)
