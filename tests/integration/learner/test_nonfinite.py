"""A non-finite gradient norm skips the optimizer step: the weights and AdamW state stay as they were, the
skip is counted (metric and JSONL line, NaN reported as null), the step's groups are still acknowledged as
used, and the next step trains as usual."""

from __future__ import annotations

import json

import pytest
import torch
from prometheus_client import CollectorRegistry

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401
from tests.unit.learner.rl.test_microbatches import ragged_groups

pytestmark = pytest.mark.redis


def test_a_nan_gradient_skips_the_update_and_the_groups_are_still_used(tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, checkpoint={"checkpoint_dir": None},
        metrics_jsonl=str(tmp_path / "steps.jsonl"), rollout_correction="decoupled_token_is",
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(ragged_groups(4, 2, seed=21))
    registry = CollectorRegistry()
    learner = Learner(cfg, registry)
    weight = learner.model.model.layers[0].mlp.down_proj.weight
    hook = weight.register_hook(lambda g: g * float("nan"))  # a NaN gradient, as an overflow would give
    try:
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        first = learner.step()
        after = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        assert all(torch.equal(before[n], after[n]) for n in before)  # no NaN published, nothing moved
        assert learner.optimizer.state_dict()["state"] == {}  # AdamW took no step
        assert first["optimizer_steps_skipped"] == 1.0 and first["version"] == 1.0
        assert registry.get_sample_value("offpolicy_learner_optimizer_steps_skipped_total") == 1.0
        assert learner.status()["last_step"].get("grad_norm") is None
        assert learner.buffer.stats().acked_total == 2  # the step's 2 groups count as used
        hook.remove()
        second = learner.step()
        assert second["optimizer_steps_skipped"] == 0.0
        assert any(not torch.equal(after[n], p) for n, p in learner.model.named_parameters())
    finally:
        learner.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["optimizer_steps_skipped"] for line in lines] == [1.0, 0.0]
    assert "grad_norm" not in lines[0] and lines[1]["grad_norm"] > 0
