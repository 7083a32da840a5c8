"""At-least-once delivery end to end with dynamic sampling and learner-written priorities, a learner killed
-9 at random points and restarted on the same folders:

- a queue buffer of zero-variance and varied groups, `screening.drop_zero_variance`: every varied group ends
  trained exactly once in the history the final weights descend from, no zero-variance group is ever
  trained (each is dropped, its lease acked like a trained one, once), none lost, nothing left leased, and
  the learner's dropped count is the buffer's;
- prioritized replay with `priorities.update` and checkpoints: the priorities in the buffer are the
  producer's or those written with the ack of a durable checkpoint; the killed steps' write nothing, their
  leases go back, no group leaves the buffer;
- under replay a refill may lease again a group its step holds: that second lease is released at once,
  the group trains once, every lease ends."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import redis

from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_delivery import (
    CHILD,
    kill_9_in_a_row,
    resumed_history,
    step_lines,
    train_to_the_end,
)
from tests.integration.learner.test_loop import config, covering_groups, tiny_dir  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.slow]
IDLE_CHILD = CHILD + "threading.Event().wait()  # max_steps reached: alive, idle, until killed\n"


def flat_and_varied(k: int, seed: int) -> tuple[list, set[str]]:
    """`k` groups F V V F V V ... V (k a multiple of 3): F's two completions rewarded alike (zero
    variance), V's 0.0 / 1.0; the ids of the F ones. Any run of the queue from a group on holds a V, so
    no step of a FIFO learner drops all it leased (each step's drops are in its metrics line)."""
    assert k % 3 == 0
    groups, flat = covering_groups(k, seed=seed, n=2, tokens=4), set()
    for i in range(0, k, 3):
        reward = float(i // 3 % 2)
        trajectories = [replace(t, reward=reward) for t in groups[i].trajectories]
        groups[i] = replace(groups[i], trajectories=trajectories)
        flat.add(groups[i].group_id)
    return groups, flat


def stored(redis_url: str, run_id: str, group_ids) -> set[str]:
    """The groups among `group_ids` still stored in the buffer (their payload is there)."""
    keys, raw = BufferKeys.for_run(run_id), redis.Redis.from_url(redis_url)
    try:
        return {g for g in group_ids if raw.exists(keys.payload(g))}
    finally:
        raw.close()


def test_kill_9_drops_every_flat_group_once_and_trains_every_varied_one_once(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    rng = random.Random(1)
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=4, micro_batch_size=8, sample_timeout_s=2.0,
        buffer={"sampler": "fifo", "max_times_sampled": 1},
        screening={"drop_zero_variance": True, "refill_timeout_s": 0.5},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 3, "keep_checkpoints": 2,
                    "resume_config": "file"},  # each process's own `max_steps`
    )  # fmt: skip
    assert cfg.delivery_mode == "checkpoint"
    groups, flat = flat_and_varied(120, seed=11)  # 40 flat, 80 varied: 20 steps of 4
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups).ok
    inserted = {g.group_id for g in groups}
    varied = inserted - flat
    incarnations = kill_9_in_a_row(cfg, tmp_path, rng, times=2, most_steps=5)
    # one killed once its checkpoint is durable, before the ack (the next step's): the next one acks it
    v = (checkpoint_versions(tmp_path / "ckpt") or [0])[-1] + 3
    incarnations += kill_9_in_a_row(
        cfg.model_copy(update={"max_steps": v}), tmp_path, rng, times=1, child=IDLE_CHILD,
        when=lambda _: v in checkpoint_versions(tmp_path / "ckpt"),
    )  # fmt: skip
    incarnations += kill_9_in_a_row(cfg, tmp_path, rng, times=1, most_steps=5)
    assert incarnations[3][1] == v  # it resumed that checkpoint (and acked its leases, dropped ones too)
    steps = tmp_path / "steps-final.jsonl"
    incarnations.append((steps, (checkpoint_versions(tmp_path / "ckpt") or [0])[-1]))
    status = train_to_the_end(cfg, steps)
    # no flat group was trained by any incarnation, not even in a step the kills lost
    every_line = [line for path, _ in incarnations for line in step_lines(path)]
    assert flat.isdisjoint(g for line in every_line for g in line["group_ids"])
    history = resumed_history(incarnations)
    trained = Counter(g for line in history for g in line["group_ids"])
    twice = [g for g, n in trained.items() if n > 1]
    assert twice == [], f"{len(twice)} groups trained twice"
    left = stored(redis_url, cfg.run_id, inserted)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        stats = buf.stats()
    assert stats.leases_outstanding == 0
    assert set(trained) <= varied and set(trained).isdisjoint(left)
    assert varied <= set(trained) | left  # every varied group trained once or still stored: none lost
    dropped = flat - left  # consumed, never trained
    assert len(dropped) + len(trained) + len(left) == len(inserted)
    # each consumed group's lease acked once: the trained ones' and the dropped ones'
    assert stats.acked_total == len(trained) + len(dropped)
    # the learner counted each drop that stayed in the history once (a lost step's drops came back and
    # were dropped again), and its status counts its own process's drops
    assert sum(line["screening/dropped"] for line in history) == len(dropped)
    final = sum(line["screening/dropped"] for line in step_lines(steps))
    assert status["groups_dropped"] == ({"zero_variance": final} if final else {})
    assert stats.size == len(left) == 0 and len(dropped) == len(flat)  # the last learner emptied the queue
    assert stats.redelivered_total > 0  # the kills did lose updates (and drops), and they came back


def test_kill_9_leaves_only_durable_priorities_and_every_group_in_the_buffer(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    """Replay: a learner trains 3 steps (flat groups dropped, with priority 0), its checkpoint is durable
    and acked with the priorities (P0). Two learner processes resume it, each killed -9 at a random point
    of its steps 4 and 5 (no checkpoint: due at 6). Restarted, the buffer holds P0 exactly, every group
    and no lease; the restarted learner's first checkpoint then writes the priorities of what it trained."""
    rng = random.Random(2)
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, micro_batch_size=4, sample_timeout_s=2.0,
        buffer={"sampler": "prioritized", "max_times_sampled": None, "priority_epsilon": 0.01},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 3},
        priorities={"update": True, "staleness_decay": 0.9},
        screening={"drop_zero_variance": True, "refill_timeout_s": 0.2}, max_steps=5,
    )  # fmt: skip
    assert cfg.delivery_mode == "checkpoint"
    groups, flat = flat_and_varied(12, seed=12)
    # the producer's priorities, distinct; the flat groups' high, so that the first learner drops some
    groups = [
        replace(g, priority=(20.0 if g.group_id in flat else 1.0) + i / 100) for i, g in enumerate(groups)
    ]
    original = {g.group_id: g.priority for g in groups}
    ids = list(original)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups).ok

    def priorities() -> dict[str, float]:
        with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
            return dict(zip(ids, buf.priorities(ids), strict=True))

    # the durable point: 3 steps, checkpoint v3 on disk, its leases acked with their groups' priorities
    first = Learner(cfg.model_copy(update={"metrics_jsonl": str(tmp_path / "steps-first.jsonl")}))
    try:
        while first.step_count < 3:  # a step that drew flat groups alone trains nothing and does not count
            first.step()
        first.persist.flush()
        first.delivery.ack_durable()
        assert first.delivery.unacked == [] and first.intake.groups_dropped.get("zero_variance", 0) > 0
    finally:
        first.close()
    p0 = priorities()
    trained_first = {g for line in step_lines(tmp_path / "steps-first.jsonl") for g in line["group_ids"]}
    assert trained_first and flat.isdisjoint(trained_first)
    for g in ids:  # the learner's where it trained or dropped the group, the producer's elsewhere
        if g in trained_first:
            assert p0[g] not in (original[g], 0.0), g
        elif g in flat:
            assert p0[g] in (original[g], 0.0), g
        else:
            assert p0[g] == original[g], g
    assert 0.0 in p0.values()  # a dropped group's priority went with its ack
    # two processes resume v3, train (and drop) in steps 4 and 5, each killed -9 before any checkpoint
    killed = kill_9_in_a_row(cfg, tmp_path, rng, times=2, most_steps=2, child=IDLE_CHILD)
    assert [resumed for _, resumed in killed] == [3, 3] and checkpoint_versions(tmp_path / "ckpt")[-1] == 3
    assert all(step_lines(path) for path, _ in killed)  # each trained at least its step 4
    assert priorities() == p0  # the killed steps' priorities were never written
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.stats().leases_outstanding > 0  # the last one's leases, left behind by the kill
    restarted = Learner(cfg.model_copy(update={"metrics_jsonl": str(tmp_path / "steps-restarted.jsonl")}))
    try:
        stats = restarted.buffer.stats()
        assert stats.leases_outstanding == 0 and stats.redelivered_total > 0  # released, back in the buffer
        assert stats.size == len(groups) and stored(redis_url, cfg.run_id, ids) == set(ids)  # replay: all
        assert priorities() == p0  # the producer's or the durable checkpoint's, nothing of the lost steps
        while restarted.step_count < 6:  # checkpoint v6, durable, acked with these steps' priorities
            restarted.step()
        restarted.persist.flush()
        restarted.delivery.ack_durable()
        stats = restarted.buffer.stats()
        assert stats.leases_outstanding == 0 and stats.size == len(groups)
    finally:
        restarted.close()
    p1 = priorities()
    again = {g for line in step_lines(tmp_path / "steps-restarted.jsonl") for g in line["group_ids"]}
    assert again and flat.isdisjoint(again)
    for g in ids:
        if g in again:  # trained at version 4 to 6: a new priority (another staleness than any before)
            assert p1[g] not in (p0[g], 0.0), g
        elif g in flat:
            assert p1[g] in (p0[g], 0.0), g
        else:
            assert p1[g] == p0[g], g


def test_a_refill_that_leases_a_held_group_again_leaves_no_lease_behind(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    """Replay, two groups, one flat: the step leases both, drops the flat one, and its refill can only
    lease one of the two again: that lease is released at once (its use goes back), the step trains the
    varied group once, and no lease is left (`delivery: step`)."""
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, sample_timeout_s=2.0,
        buffer={"sampler": "prioritized", "max_times_sampled": None}, checkpoint={"checkpoint_dir": None},
        screening={"drop_zero_variance": True, "refill_timeout_s": 0.2},
    )  # fmt: skip
    assert cfg.delivery_mode == "step"
    groups, _ = flat_and_varied(3, seed=13)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups[:2]).ok  # F, V
    learner = Learner(cfg)
    try:
        learner.step()
        stats = learner.buffer.stats()
    finally:
        learner.close()
    assert stats.leased_total > 2  # the refill leased a group of the step again
    assert stats.leases_outstanding == 0
    assert stats.acked_total + stats.redelivered_total == stats.leased_total  # the second one released
    assert stats.acked_total == 2  # F dropped (acked), V trained once
