"""Dynamic sampling: DAPO's soft overlong punishment by hand, the drop reasons, and the refill loop that
keeps a step's trainable groups at what it sampled (bounded rounds, then it trains what it has)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.config.screening import ScreeningConfig
from offpolicy.learner.rl.dynamic_sampling import fill, overlong_penalty, sift, truncated_rows


def group(rewards, lengths=None, finish=None, max_tokens=64) -> TrajectoryGroup:
    lengths = lengths or [4] * len(rewards)
    finish = finish or ["stop"] * len(rewards)
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex, prompt_id="p", prompt_ids=np.array([1, 2, 3], dtype=np.int32),
        policy_version=0, actor_id="a", created_at=time.time(),
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens),
        trajectories=[
            Trajectory(
                response_ids=np.full(n, 5, dtype=np.int32), behavior_logprobs=np.full(n, -1.0, np.float32),
                reward=r, finish_reason=f,
            )
            for r, n, f in zip(rewards, lengths, finish, strict=True)
        ],
    )  # fmt: skip


def test_the_overlong_punishment_is_dapos():
    # max 100 tokens, a buffer of 20: free up to 80, -penalty/2 halfway, -penalty at 100 and past it
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(130, 100, 20, 1.0) == -1.0


def test_sift_drops_by_reason_and_punishes_before_the_variance_test():
    flat, varied = group([1.0, 1.0, 1.0]), group([0.0, 1.0, 1.0])
    cut = group([1.0, 0.0], finish=["length", "length"])
    off = ScreeningConfig()
    assert sift([flat, varied, cut], off) == ([flat, varied, cut], [])  # off by default: all train
    keep, dropped = sift([flat, varied, cut], ScreeningConfig(drop_zero_variance=True, overlong="filter"))
    assert keep == [varied] and [(d.group, d.reason) for d in dropped] == [
        (flat, "zero_variance"), (cut, "all_truncated")
    ]  # fmt: skip
    # equal task rewards, but one completion ran into the punishment's buffer: the group has a signal now
    long = group([1.0, 1.0], lengths=[4, 60], max_tokens=64)
    cfg = ScreeningConfig(drop_zero_variance=True, overlong="punish", overlong_buffer_tokens=8)
    (shaped,), dropped = sift([long], cfg)
    assert not dropped and [t.reward for t in shaped.trajectories] == [1.0, pytest.approx(0.5)]
    assert [t.reward for t in long.trajectories] == [1.0, 1.0]  # the buffer's copy is left alone


def test_fill_refills_dropped_groups_up_to_the_sampled_count():
    cfg = ScreeningConfig(drop_zero_variance=True, max_refill_rounds=3)
    first = [group([1.0, 1.0]), group([0.0, 1.0]), group([1.0, 1.0]), group([0.0, 1.0])]
    supply = [group([1.0, 1.0]), group([0.0, 1.0]), group([0.5, 1.0])]
    asked: list[int] = []

    def more(n):
        asked.append(n)
        taken, supply[:] = supply[:n], supply[n:]
        return taken

    filled = fill(first, cfg, more)
    assert len(filled.groups) == 4 and not filled.short
    assert asked == [2, 1]  # two dropped: 2 more (one of them flat again), then 1
    assert [d.reason for d in filled.dropped] == ["zero_variance"] * 3 and filled.rounds == 2


def test_fill_trains_what_it_has_after_the_rounds_or_an_empty_buffer():
    cfg = ScreeningConfig(drop_zero_variance=True, max_refill_rounds=2)
    flat = [group([1.0, 1.0]) for _ in range(3)]
    filled = fill([*flat, group([0.0, 1.0])], cfg, lambda n: [group([2.0, 2.0]) for _ in range(n)])
    assert len(filled.groups) == 1 and filled.short and filled.rounds == 2  # bounded
    empty = fill([*flat, group([0.0, 1.0])], cfg, lambda n: [])
    assert len(empty.groups) == 1 and empty.short and empty.rounds == 1  # the buffer had no more
    none = fill([group([0.0, 1.0])], cfg, lambda n: pytest.fail("nothing was dropped: no refill"))
    assert len(none.groups) == 1 and not none.short and none.rounds == 0


def test_truncated_rows_are_in_collates_row_order():
    groups = [group([0.0, 1.0], finish=["stop", "length"]), group([1.0], finish=["length"])]
    assert truncated_rows(groups).tolist() == [False, True, True]


def test_dropping_zero_variance_groups_is_refused_with_pure_distillation():
    from pydantic import ValidationError

    from offpolicy.learner.config import LearnerConfig

    base = {"model_path": "m", "screening": {"drop_zero_variance": True}}
    with pytest.raises(ValidationError, match="drop_zero_variance"):
        LearnerConfig.model_validate(base | {"teacher": {"model_path": "t", "task_reward_weight": 0.0}})
    LearnerConfig.model_validate(base | {"teacher": {"model_path": "t", "task_reward_weight": 0.5}})
    LearnerConfig.model_validate(base)
