"""`screen`: each group is checked against the model on its own; a bad one is named with its field and
its neighbours stay trainable."""

from __future__ import annotations

import numpy as np

from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.rl.screening import ModelLimits, field_label, screen

LIMITS = ModelLimits(vocab_size=100, max_positions=16)


def _group(gid, prompt=(1, 2, 3), responses=((4, 5),), temperature=1.0, lp_len=None):
    trajs = [
        Trajectory(
            response_ids=np.asarray(r, dtype=np.int32),
            behavior_logprobs=np.full(len(r) if lp_len is None else lp_len, -1.0, dtype=np.float32),
            reward=1.0,
            finish_reason="stop",
        )
        for r in responses
    ]
    return TrajectoryGroup(
        group_id=gid, prompt_id="p", prompt_ids=np.asarray(prompt, dtype=np.int32), policy_version=0,
        actor_id="a", created_at=0.0, sampling=SamplingParams(temperature=temperature), trajectories=trajs,
        metadata={},
    )  # fmt: skip


def test_each_kind_of_untrainable_group_is_named_and_the_neighbours_pass():
    groups = [
        _group("ok1"),
        _group("vocab", responses=((4, 5), (7, 100))),
        _group("prompt_vocab", prompt=(1, -1)),
        _group("empty", responses=((4,), ())),
        _group("too_long", prompt=tuple(range(10)), responses=((1,) * 7,)),
        _group("greedy", temperature=0.0),
        _group("lengths", lp_len=3),
        _group("no_prompt", prompt=()),
        _group("ok2", prompt=tuple(range(10)), responses=((1,) * 6,)),
    ]
    good, bad = screen(groups, LIMITS)
    assert [g.group_id for g in good] == ["ok1", "ok2"]
    assert [(r.group.group_id, r.field) for r in bad] == [
        ("vocab", "trajectories[1].response_ids"),
        ("prompt_vocab", "prompt_ids"),
        ("empty", "trajectories[1].response_ids"),
        ("too_long", "trajectories[0].response_ids"),
        ("greedy", "sampling.temperature"),
        ("lengths", "trajectories[0].behavior_logprobs"),
        ("no_prompt", "prompt_ids"),
    ]
    assert "[0, 100)" in bad[0].reason and "got 7..100" in bad[0].reason
    assert "exceed the model's 16 positions" in bad[3].reason


def test_every_field_screening_names_is_a_declared_metric_label():
    from offpolicy.learner.metrics import REJECTION_FIELDS

    groups = [
        _group("vocab", responses=((4, 100),)), _group("p", prompt=(1, -1)), _group("e", responses=((),)),
        _group("greedy", temperature=0.0), _group("lengths", lp_len=3),
    ]  # fmt: skip
    _, bad = screen(groups, LIMITS)
    assert {field_label(r.field) for r in bad} == set(REJECTION_FIELDS)


def test_field_labels_drop_list_indices():
    assert field_label("trajectories[12].response_ids") == "trajectories.response_ids"
    assert field_label("prompt_ids") == "prompt_ids"
