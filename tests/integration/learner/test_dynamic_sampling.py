"""Dynamic sampling with the real learner and Redis: zero-variance groups are dropped and replaced by more
leases, so each step trains `groups_per_step` groups that carry a signal; dropped groups are acknowledged
with the step's checkpoint like trained ones (consumed once, never trained, nothing left leased); and the
setting changes what the learner trains (off: the flat groups train)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import behaviour, config, make_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis


def flat_and_varied(behaviour) -> list:  # noqa: F811
    """F F V F V V: F's completions all rewarded 1.0 (zero variance), V's 0.0 / 1.0 alternately."""
    groups = make_groups(behaviour, 6, version=0, n=2, tokens=4, seed=3)
    out = []
    for g, kind in zip(groups, "FFVFVV", strict=True):
        rewards = [1.0, 1.0] if kind == "F" else [0.0, 1.0]
        trajectories = [replace(t, reward=r) for t, r in zip(g.trajectories, rewards, strict=True)]
        out.append(replace(g, trajectories=trajectories, prompt_id=kind))
    return out


def run_one_step(cfg, groups) -> tuple[dict, list[str], Learner]:
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg)
    trained: list[str] = []
    execute = learner._execute
    learner._execute = lambda command, gs, *a: (
        trained.extend(g.prompt_id for g in gs),
        execute(command, gs, *a),
    )[1]
    metrics = learner.step()
    return metrics, trained, learner


@pytest.mark.parametrize("screening", [True, False], ids=["dynamic", "off"])
def test_flat_groups_are_dropped_acked_and_replaced(screening, behaviour, tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, sample_timeout_s=2.0,
        buffer={"sampler": "fifo", "max_times_sampled": 1},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 1},
        screening={"drop_zero_variance": screening, "refill_timeout_s": 0.5},
    )  # fmt: skip
    metrics, trained, learner = run_one_step(cfg, flat_and_varied(behaviour))
    try:
        if not screening:
            assert trained == ["F", "F"] and learner.status()["groups_dropped"] == {}
            return
        # F F dropped -> 2 more: V F -> F dropped -> 1 more: V; the step trains V V
        assert trained == ["V", "V"]
        assert metrics["screening/dropped"] == 3 and metrics["screening/refill_rounds"] == 2
        assert metrics["screening/short"] == 0
        assert learner.status()["groups_dropped"] == {"zero_variance": 3}
        assert learner.metrics.groups_dropped.labels(reason="zero_variance")._value.get() == 3
        learner.persist.flush()  # the step's checkpoint is durable: its leases, dropped ones included, acked
        learner.delivery.ack_durable()
        stats = learner.buffer.stats()
        assert stats.leased_total == 5 and stats.acked_total == 5 and stats.leases_outstanding == 0
        assert stats.redelivered_total == 0
    finally:
        learner.close()


@pytest.mark.parametrize("overlong", ["filter", "off"])
def test_truncated_completions_get_no_loss_under_filter(overlong, behaviour, tiny_dir, redis_url, tmp_path):  # noqa: F811
    groups = make_groups(behaviour, 3, version=0, n=2, tokens=4, seed=4)  # FIFO: the first 2 train
    ends = ("stop", "length")  # the first completion of each group stopped, the second ran out of tokens
    groups = [
        replace(
            g, trajectories=[replace(t, finish_reason=e) for t, e in zip(g.trajectories, ends, strict=True)]
        )
        for g in groups
    ]
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, checkpoint={"checkpoint_dir": None},
        buffer={"sampler": "fifo", "max_times_sampled": 1},
        screening={"overlong": overlong},
    )  # fmt: skip
    metrics, trained, learner = run_one_step(cfg, groups)
    learner.close()
    assert len(trained) == 2
    every = sum(len(t.response_ids) for g in groups[:2] for t in g.trajectories)
    finished = sum(len(g.trajectories[0].response_ids) for g in groups[:2])
    assert metrics["tokens"] == (finished if overlong == "filter" else every)
