"""Where a learner keeps its files, on the tiny model and the embedded Redis: weights and checkpoints live in
a folder per run, and a checkpoint of another run or model is refused."""

from __future__ import annotations

import uuid

import pytest

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.errors import CheckpointMismatch
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, covering_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis


def test_weights_and_checkpoints_default_to_a_folder_per_run():
    a = LearnerConfig(model_path="m", run_id="run-a")
    b = LearnerConfig(model_path="m", run_id="run-b")
    assert str(a.weights_path) == "runs/run-a/weights" and str(a.checkpoint_path) == "runs/run-a/checkpoints"
    assert a.weights_path != b.weights_path and a.checkpoint_path != b.checkpoint_path
    assert LearnerConfig(model_path="m", checkpoint={"checkpoint_dir": None}).checkpoint_path is None


def test_a_checkpoint_of_another_run_or_model_is_refused(tiny_dir, redis_url, tmp_path):  # noqa: F811
    shared = {"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 1}
    cfg = config(tiny_dir, redis_url, tmp_path, checkpoint=shared)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(covering_groups(2, seed=4))
    learner = Learner(cfg)
    try:
        learner.step()
    finally:
        learner.close()
    other_run = cfg.model_copy(update={"run_id": f"other-{uuid.uuid4().hex[:8]}"})
    with pytest.raises(CheckpointMismatch, match="was written for run"):
        Learner(other_run)
    bigger = make_tiny_model(tmp_path / "bigger", hidden_size=128, num_heads=2, num_layers=1)
    with pytest.raises(CheckpointMismatch, match="model"):
        Learner(cfg.model_copy(update={"model_path": str(bigger)}))
