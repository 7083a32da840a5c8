"""At-least-once delivery end to end: a learner killed -9 at random points of its steps, five times in a
row, restarted each time on the same folders, on 600 groups of a queue buffer. Every inserted group ends
trained exactly once in the history the final weights descend from, or still stored; none is lost and
none is trained twice. An untrainable group is set aside in the dead-letter list and its neighbours train."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis

from offpolicy.buffer.errors import BufferNotReady
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.errors import IntakeStopped
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, covering_groups, tiny_dir  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
CHILD = """
import sys, threading
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.trainer import Learner
cfg = LearnerConfig.model_validate_json(open(sys.argv[1]).read())
Learner(cfg).run(threading.Event())
"""


def train_to_the_end(cfg, steps: Path) -> dict:
    """A learner of `cfg` (its steps logged to `steps`) trains until the buffer is empty, checkpoints and
    stops cleanly: the last incarnation of a run killed before. Returns its `status()` before it stops."""
    learner = Learner(cfg.model_copy(update={"metrics_jsonl": str(steps), "sample_timeout_s": 0.5}))
    try:
        while True:
            try:
                learner.step()
            except BufferNotReady:
                break
            except IntakeStopped:  # checkpoints slower than steps (a loaded machine): the loop waits too
                time.sleep(0.2)
        learner.checkpoint()
        return learner.status()
    finally:
        learner.close()


def step_lines(path: Path) -> list[dict]:
    """The step lines a learner's `metrics_jsonl` holds (a line torn by a kill left out)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


Incarnation = tuple[Path, int]
"""One learner process of a run: its steps file and the checkpoint version it resumed (0: none)."""


def kill_9_in_a_row(
    cfg,
    tmp_path: Path,
    rng: random.Random,
    times: int,
    most_steps: int = 7,
    child: str = CHILD,
    when: Callable[[Path], bool] | None = None,
) -> list[Incarnation]:
    """`times` learner subprocesses of `cfg` (`child` runs one from its config file), one after the other
    on the same folders, each killed -9 somewhere after 1 to `most_steps` logged steps (inside a step, a
    publish or a checkpoint write), or at once when `when(its steps file)` holds. Numbered on from the
    incarnations of earlier calls (`steps-<i>.jsonl`, `cfg-<i>.json` in `tmp_path`)."""
    incarnations: list[Incarnation] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = len(list(tmp_path.glob("cfg-*.json")))
    for i in range(first, first + times):
        steps = tmp_path / f"steps-{i}.jsonl"
        resumed = (checkpoint_versions(tmp_path / "ckpt") or [0])[-1]
        incarnations.append((steps, resumed))
        cfg_i = cfg.model_copy(update={"metrics_jsonl": str(steps)})
        (tmp_path / f"cfg-{i}.json").write_text(cfg_i.model_dump_json())
        proc = subprocess.Popen(
            [sys.executable, "-c", child, str(tmp_path / f"cfg-{i}.json")], cwd=ROOT, env=env
        )
        try:
            done = when or (lambda path, n=rng.randint(1, most_steps): len(step_lines(path)) >= n)
            deadline = time.monotonic() + 120
            while not done(steps):
                assert proc.poll() is None, "the learner subprocess died"
                assert time.monotonic() < deadline, "the learner subprocess made no progress"
                time.sleep(0.01)
            if when is None:
                time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside a step, a publish or a checkpoint write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    return incarnations


def resumed_history(incarnations: list[Incarnation]) -> list[dict]:
    """The step lines of the history the final weights descend from: each incarnation's steps up to the
    checkpoint the next one resumed (the last one's all)."""
    out: list[dict] = []
    for (path, _), (_, next_resumed) in zip(incarnations, [*incarnations[1:], (None, 10**9)], strict=True):
        out += [line for line in step_lines(path) if line["version"] <= next_resumed]
    return out


def test_kill_9_five_times_trains_every_group_exactly_once_in_the_resumed_history(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    rng = random.Random(0)
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=4, micro_batch_size=8, sample_timeout_s=2.0,
        buffer={"sampler": "fifo", "max_times_sampled": 1},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 3, "keep_checkpoints": 2},
    )  # fmt: skip
    assert cfg.delivery_mode == "checkpoint"
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        groups = covering_groups(600, seed=7, n=2, tokens=4)  # more than 5 incarnations use on a fast machine
        assert buf.insert_many(groups).ok
    inserted = {g.group_id for g in groups}
    incarnations = kill_9_in_a_row(cfg, tmp_path, rng, times=5)
    # the last incarnation trains until the buffer is empty, checkpoints, and stops cleanly
    steps = tmp_path / "steps-final.jsonl"
    incarnations.append((steps, (checkpoint_versions(tmp_path / "ckpt") or [0])[-1]))
    train_to_the_end(cfg, steps)
    trained = Counter(g for line in resumed_history(incarnations) for g in line["group_ids"])
    twice = [g for g, n in trained.items() if n > 1]
    assert twice == [], f"{len(twice)} groups trained twice"
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        stats = buf.stats()
    assert set(trained) <= inserted
    assert stats.leases_outstanding == 0
    assert stats.acked_total == len(trained)  # each trained group's lease acked once, none lost
    assert stats.size + len(trained) == len(inserted)  # the rest still stored (none here: all trained)
    assert stats.size == 0 and stats.redelivered_total > 0  # the kills did lose updates, and they came back


def test_poison_groups_in_a_batch_are_dead_lettered_and_their_neighbours_train(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    """One sampled batch holds two valid groups, a group with a token id past the model's vocabulary, and
    two whose stored payloads were corrupted behind the buffer's back (garbage bytes, a truncated frame):
    the step trains the two valid ones, the three others are in the dead-letter list with their field."""
    cfg = config(tiny_dir, redis_url, tmp_path, groups_per_step=5, checkpoint={"checkpoint_dir": None})
    good = covering_groups(4, seed=8)
    rng = np.random.default_rng(0)
    bad = TrajectoryGroup(
        group_id=uuid.uuid4().hex, prompt_id="bad", prompt_ids=np.asarray([1, 2, 3], dtype=np.int32),
        policy_version=0, actor_id="test", created_at=time.time(), sampling=SamplingParams(temperature=1.0),
        trajectories=[Trajectory(response_ids=np.asarray([5, 500, 6], dtype=np.int32),  # 500 >= vocab 101
                                 behavior_logprobs=-rng.random(3, dtype=np.float32) - 1, reward=1.0,
                                 finish_reason="stop")],
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many([good[0], bad, good[1], good[2], good[3]]).ok
    keys, raw = BufferKeys.for_run(cfg.run_id), redis.Redis.from_url(redis_url)
    raw.set(keys.payload(good[2].group_id), b"garbage")
    raw.set(keys.payload(good[3].group_id), b"OPTG\x02\x00\xff\xff\xff\xff")  # a truncated frame
    raw.close()
    learner = Learner(cfg)
    try:
        metrics = learner.step()
        dead = {d["group_id"]: d for d in learner.buffer.dead_letters()}
        stats = learner.buffer.stats()
    finally:
        learner.close()
    assert metrics["groups"] == 2.0  # the loop survived; the valid neighbours trained
    assert set(dead) == {bad.group_id, good[2].group_id, good[3].group_id}
    assert dead[bad.group_id]["field"] == "trajectories[0].response_ids"
    assert "[0, 101)" in dead[bad.group_id]["reason"]
    assert all(dead[g.group_id]["reason"] for g in good[2:])
    assert stats.size == 0 and stats.leases_outstanding == 0
