"""The learner config's cadences said in both units (learner/config/units.py): a policy version is one
optimizer step, a learner step takes ppo_epochs x groups_per_step / mini_batch_groups of them."""

from __future__ import annotations

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.units import units


def test_the_cadences_are_said_in_versions_and_learner_steps():
    """verl's users count steps: at 256 groups a step in mini-batches of 64, a version is a quarter step, so
    max_staleness 4 is one learner step; publish_every and checkpoint_every count learner steps."""
    cfg = LearnerConfig.model_validate(
        {"model_path": "/m", "groups_per_step": 256, "mini_batch_groups": 64, "buffer": {"max_staleness": 4},
         "publish": {"publish_every": 2}, "checkpoint": {"checkpoint_dir": "/c", "checkpoint_every": 10}}
    )  # fmt: skip
    expected = [
        "a policy version is one optimizer step",
        "a learner step takes 4 (ppo_epochs 1 x groups_per_step 256 / mini_batch_groups 64)",
        "buffer.max_staleness 4 versions = 1 learner step(s)",
        "publish_every 2 learner step(s) = 8 versions",
        "checkpoint_every 10 learner step(s) = 40 versions",
        "eval.every_versions 8 = 2 learner step(s)",
    ]
    assert units(cfg, eval_every_versions=8) == "; ".join(expected)
    unbounded = units(LearnerConfig.model_validate({"model_path": "/m"}))
    assert "buffer.max_staleness unbounded" in unbounded and "eval" not in unbounded
    control = {"mode": "auto", "max_staleness": 12}
    given = {"model_path": "/m", "buffer": {"max_staleness": 4}, "control": control}
    said = "buffer.max_staleness 4 versions = 4 learner step(s) at start, then set by control.mode auto "
    assert said + "within [1, 12] versions" in units(LearnerConfig.model_validate(given))
