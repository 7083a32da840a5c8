"""The learner estimates its memory per rank before it loads a weight, reports it in its status, and
refuses to start when the plan exceeds what a rank may use."""

from __future__ import annotations

import pytest

from offpolicy.learner.errors import MemoryPlanError
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis


def test_a_plan_over_the_limit_is_refused_before_loading(tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(tiny_dir, redis_url, tmp_path, memory_limit_gib=0.001, checkpoint={"checkpoint_dir": None})
    with pytest.raises(MemoryPlanError, match=r"GiB per rank .* micro_batch_tokens \(now 16384\)"):
        Learner(cfg)


def test_the_plan_is_in_the_status_and_follows_the_token_budget(tiny_dir, redis_url, tmp_path):  # noqa: F811
    plans = []
    for budget in (1024, 4096):
        cfg = config(
            tiny_dir, redis_url, tmp_path / str(budget), micro_batch_tokens=budget, memory_limit_gib=1.0,
            checkpoint={"checkpoint_dir": None},
        )  # fmt: skip
        learner = Learner(cfg)
        try:
            plans.append(learner.status()["memory_plan"])
        finally:
            learner.close()
    small, large = plans
    assert small["total"] < 1.0 and small["weights"] > 0
    assert large["activations"] == pytest.approx(4 * small["activations"])
