"""Priorities the learner keeps current, with the real learner and Redis: after a step its groups'
priorities in the buffer are the learner's (written with the ack, `delivery: step`), the `prioritized`
sampler then draws the groups that carry a signal, `priorities.beta` puts importance weights on the
groups the step trains, and every lease is acknowledged once (nothing lost, nothing left leased)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.rl.priorities import WEIGHT_KEY, priority
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import behaviour, config, make_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis


def flat_and_varied(behaviour, kinds: str) -> list:  # noqa: F811
    """One group per letter: F's completions all rewarded 1.0 (zero variance), V's 0.0 / 1.0; every group
    inserted with the producer's priority 1.0."""
    out = []
    for i, (g, kind) in enumerate(zip(make_groups(behaviour, len(kinds), version=0, n=2, tokens=4, seed=5),
                                      kinds, strict=True)):  # fmt: skip
        rewards = [1.0, 1.0] if kind == "F" else [0.0, 1.0]
        trajectories = [replace(t, reward=r) for t, r in zip(g.trajectories, rewards, strict=True)]
        out.append(replace(g, trajectories=trajectories, prompt_id=f"{kind}{i}", priority=1.0))
    return out


def recording(learner: Learner) -> list[list]:
    """The groups each `_execute` of a step trains, in order."""
    steps: list[list] = []
    execute = learner._execute

    def run(command, gs, *a):
        if command.op == "step":
            steps.append(list(gs))
        return execute(command, gs, *a)

    learner._execute = run
    return steps


def started(cfg, groups: list) -> tuple[Learner, list[list]]:
    """`groups` inserted into the run's buffer, its learner started, recording what each step trains."""
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg)
    return learner, recording(learner)


def durable_replay(tiny_dir, redis_url, tmp_path):  # noqa: F811
    """Prioritized replay with learner-written priorities, 2 groups per step, a checkpoint every 2 steps
    (`delivery: checkpoint`: acks and their priorities go once a checkpoint is durable)."""
    return config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, sample_timeout_s=2.0,
        buffer={"sampler": "prioritized", "max_times_sampled": None, "priority_epsilon": 0.01},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2},
        priorities={"update": True},
    )  # fmt: skip


def test_the_learner_writes_priorities_and_the_sampler_follows(behaviour, tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, sample_timeout_s=2.0,
        buffer={"sampler": "prioritized", "max_times_sampled": None, "priority_epsilon": 0.01},
        checkpoint={"checkpoint_dir": None}, priorities={"update": True, "staleness_decay": 0.95},
    )  # fmt: skip
    groups = flat_and_varied(behaviour, "FFFVVV")
    by_id = {g.group_id: g for g in groups}
    learner, steps = started(cfg, groups)
    try:
        learner.step()
        written = learner.buffer.priorities([g.group_id for g in steps[0]])
        expect = [priority(g, 1, 0.95) for g in steps[0]]  # version 1 after the step's one optimizer step
        assert written == pytest.approx(expect) and all(p != 1.0 for p in written)
        for _ in range(12):  # until every group was trained once and holds the learner's priority
            if 1.0 not in learner.buffer.priorities(list(by_id)):
                break
            learner.step()
        now = dict(zip(by_id, learner.buffer.priorities(list(by_id)), strict=True))
        assert 1.0 not in now.values()
        assert all(now[i] == 0.0 for i, g in by_id.items() if g.prompt_id[0] == "F")
        assert all(now[i] > 0.1 for i, g in by_id.items() if g.prompt_id[0] == "V")
        first = len(steps)
        for _ in range(8):
            learner.step()
        picks = Counter(g.prompt_id[0] for gs in steps[first:] for g in gs)
        assert picks["V"] >= 13, picks  # weight ~0.5 vs 0.01: the flat groups all but never come back
        stats = learner.buffer.stats()
        assert stats.leases_outstanding == 0 and stats.leased_total == stats.acked_total == 2 * len(steps)
        assert stats.redelivered_total == 0 and stats.size == 6  # replay: nothing removed, nothing lost
        assert learner.status()["leases_unacked"] == 0 and learner.delivery.priorities == {}
    finally:
        learner.close()


def test_beta_puts_importance_weights_on_the_trained_groups(behaviour, tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, sample_timeout_s=2.0,
        buffer={"sampler": "prioritized", "max_times_sampled": None, "priority_epsilon": 0.0,
                "priority_alpha": 1.0},
        checkpoint={"checkpoint_dir": None}, priorities={"beta": 1.0},
    )  # fmt: skip
    pair = flat_and_varied(behaviour, "VV")
    groups = [replace(g, priority=p) for g, p in zip(pair, [1.0, 4.0], strict=True)]
    learner, steps = started(cfg, groups)
    try:
        learner.step()
        weights = {g.priority: float(g.metadata[WEIGHT_KEY]) for g in steps[0]}
        assert weights == pytest.approx({1.0: 1.0, 4.0: 0.25})  # (N P)^-1 over its max: p_min / p
        # `update` off: the producer's priorities stay
        assert sorted(learner.buffer.priorities([g.group_id for g in groups])) == [1.0, 4.0]
    finally:
        learner.close()


def test_priorities_go_with_the_durable_ack_and_die_with_a_crash(behaviour, tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = durable_replay(tiny_dir, redis_url, tmp_path)
    assert cfg.delivery_mode == "checkpoint"
    groups = flat_and_varied(behaviour, "VVFF")
    ids = [g.group_id for g in groups]
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg)
    try:
        learner.step()  # not checkpointed: not acked, so the buffer still holds the producer's priorities
        assert learner.buffer.priorities(ids) == [1.0] * 4 and len(learner.delivery.priorities) == 2
        learner.step()  # checkpoint at step 2: durable, then acked with the priorities of both steps
        learner.persist.flush()
        learner.delivery.ack_durable()
        after_ack = learner.buffer.priorities(ids)
        assert after_ack != [1.0] * 4 and learner.delivery.priorities == {}
        learner.step()  # trained, never checkpointed: the "crash" below loses it
        assert len(learner.delivery.priorities) == 2
        learner.persist.flush()  # its publish written (no checkpoint, no ack): the restart's start-up
        # cleanup of partial folders must not race a write of this still-living learner
        restarted = Learner(cfg)  # the same run: acks the checkpoint's leases, releases the lost step's
        try:
            stats = restarted.buffer.stats()
            assert stats.leases_outstanding == 0 and stats.redelivered_total == 2
            assert restarted.buffer.priorities(ids) == after_ack  # the lost update wrote nothing
            assert stats.size == 4  # replay: nothing removed, nothing lost
        finally:
            restarted.close()
    finally:
        learner.delivery.unacked = []  # the "crashed" process: nothing of its own to give back
        learner.close()


@pytest.mark.parametrize("priorities", [(1.0, 4.0), (2.0, 2.0)], ids=["unequal", "equal"])
def test_the_importance_weights_reach_the_loss(priorities, behaviour, tiny_dir, redis_url, tmp_path):  # noqa: F811
    """One step on the same two groups with beta 1 and beta 0: unequal priorities weight the groups'
    advantages unequally, so the updates differ; equal ones weight both 1, so they are the same."""
    trained = {}
    for beta in (0.0, 1.0):
        cfg = config(
            tiny_dir, redis_url, tmp_path / str(beta), groups_per_step=2, sample_timeout_s=2.0,
            buffer={"sampler": "prioritized", "max_times_sampled": None, "priority_epsilon": 0.0},
            checkpoint={"checkpoint_dir": None}, priorities={"beta": beta}, optimizer={"lr": 1e-2},
        )  # fmt: skip
        pair = flat_and_varied(behaviour, "VV")
        pair[1] = replace(
            pair[1], trajectories=[replace(t, reward=2 * t.reward) for t in pair[1].trajectories]
        )
        with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
            buf.insert_many([replace(g, priority=p) for g, p in zip(pair, priorities, strict=True)])
        learner = Learner(cfg)
        try:
            learner.step()
            trained[beta] = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        finally:
            learner.close()
    diff = max((trained[0.0][k] - trained[1.0][k]).abs().max().item() for k in trained[0.0])
    print(f"beta 0 vs 1: weights {diff:.1e} apart")
    if priorities[0] == priorities[1]:  # the same update (the sampler's order may sum in another order)
        assert diff <= 3e-5, diff
    else:
        assert diff > 1e-3, diff  # ~2e-2 here, against ~3e-6 of float noise


def test_the_written_priority_grows_with_the_groups_is_deviation(behaviour, tiny_dir, redis_url, tmp_path):  # noqa: F811
    """Two groups with the same rewards; one's behaviour log-probs are 0.3 above the policy's (its actor was
    off), so |log pi_old - log mu| = 0.3 on each token: the priority written back with its ack is 1.3 x
    that of the other, whose behaviour was the policy's own. With no rollout correction configured too."""
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, sample_timeout_s=2.0,
        buffer={"sampler": "prioritized", "max_times_sampled": None},
        checkpoint={"checkpoint_dir": None}, priorities={"update": True, "staleness_decay": 1.0},
    )  # fmt: skip
    assert not cfg.rollout_correction.bypass_mode and cfg.rollout_correction.rollout_is is None
    on, off = flat_and_varied(behaviour, "VV")
    off = replace(
        off,
        trajectories=[
            replace(t, behavior_logprobs=(np.asarray(t.behavior_logprobs) + 0.3).astype(np.float32))
            for t in off.trajectories
        ],
    )
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many([on, off])
    learner = Learner(cfg)
    try:
        learner.step()
        p_on, p_off = learner.buffer.priorities([on.group_id, off.group_id])
        base_on, base_off = priority(on, 1, 1.0), priority(off, 1, 1.0)  # |A| alone, no deviation
        assert base_on == pytest.approx(base_off) and base_on > 0.5
        assert p_on == pytest.approx(base_on, rel=1e-3)  # its own policy's samples: w = 1
        assert p_off / base_off == pytest.approx(1.3, rel=1e-3)
    finally:
        learner.close()


def test_a_crash_between_the_durable_checkpoint_and_its_ack_keeps_the_priorities(
    behaviour,  # noqa: F811
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    """The checkpoint of step 2 is durable, but the learner dies before its next step acks it: the restart
    acks the checkpoint's leases with the priorities the checkpoint recorded (its meta), not without."""
    cfg = durable_replay(tiny_dir, redis_url, tmp_path)
    groups = flat_and_varied(behaviour, "VVVV")
    ids = [g.group_id for g in groups]
    learner, steps = started(cfg, groups)
    try:
        learner.step()
        learner.step()  # checkpoint v2 queued with its 4 leases and their groups' new priorities
        learner.persist.flush()  # durable; its ack would come with the next step, which never runs
        written = sorted(learner.delivery.priorities.values())  # what the acks should carry
        assert len(written) == 4 and learner.buffer.priorities(ids) == [1.0] * 4
        trained = {g.group_id for gs in steps for g in gs}  # replay: a group may be drawn by both steps
        restarted = Learner(cfg)  # the same run: acks the resumed checkpoint's leases
        try:
            now = dict(zip(ids, restarted.buffer.priorities(ids), strict=True))
            assert all(now[g] == 1.0 for g in ids if g not in trained)  # never trained: the producer's
            for g in trained:  # the priority the checkpoint recorded for (one of) its leases
                assert now[g] != 1.0 and min(abs(now[g] - w) for w in written) < 1e-6, (now[g], written)
            assert restarted.buffer.stats().leases_outstanding == 0
        finally:
            restarted.close()
    finally:
        learner.delivery.unacked = []  # the "crashed" process: nothing of its own to give back
        learner.close()
