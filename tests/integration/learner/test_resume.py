"""kill -9 a learner subprocess mid-run; a new learner resumes from the newest checkpoint, its version
continues, and no group is trained more often than `max_times_sampled` allows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model, make_tiny_model
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.persist.version_folders import published_versions
from offpolicy.learner.trainer import Learner
from offpolicy.weights.manifest import read_manifest, weights_sha256
from offpolicy.weights.record import PolicyStore
from tests.integration.learner.test_loop import config, make_groups, tiny_dir  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
CHILD = """
import sys, threading
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.trainer import Learner
from offpolicy.learner.persist.version_folders import published_versions
from offpolicy.weights.manifest import read_manifest
cfg = LearnerConfig.model_validate_json(open(sys.argv[1]).read())
Learner(cfg).run(threading.Event())
"""


def test_resume_after_kill_9(tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny_dir,
        redis_url,
        tmp_path,
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 1},
    )
    assert cfg.buffer.max_times_sampled == 1
    behaviour = load_model(tiny_dir, "cpu").eval()
    buf = ReplayBuffer(redis_url, cfg.run_id, cfg.buffer)
    # more than the child can train before it is killed, however fast the machine (2 groups a step)
    buf.insert_many(make_groups(behaviour, 96, version=0, temperature=0.9))
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    store = PolicyStore(redis_url, cfg.run_id)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "cfg.json")], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120

        # Checkpoints are written in the background and may trail the published version: wait for both.
        def ready() -> bool:
            rec = store.read()
            ckpts = checkpoint_versions(tmp_path / "ckpt")
            return rec is not None and rec.version >= 3 and bool(ckpts) and ckpts[-1] >= 2

        while not ready():
            assert child.poll() is None, "the learner subprocess died"
            assert time.monotonic() < deadline, "the learner subprocess made no progress"
            time.sleep(0.1)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    before = buf.stats()
    newest_ckpt = checkpoint_versions(tmp_path / "ckpt")[-1]
    assert newest_ckpt >= 2

    learner = Learner(cfg)
    try:
        assert learner.version == newest_ckpt  # the version of the weights it holds, never relabelled
        learner.writer.flush()  # the first publish goes through the background writer too
        assert store.read().version == newest_ckpt  # re-published, so the actors follow these weights
        resumed = learner.version
        learner.step()
        learner.writer.flush()
        assert learner.version == resumed + 1
        assert store.read().version == resumed + 1
    finally:
        learner.close()
    after = buf.stats()
    # The killed learner's leases: those in its newest checkpoint were acked by the new one, the rest went
    # back to the buffer (redelivered); the new step's leases were acked once its checkpoint was durable.
    assert before.leases_outstanding > 0 and after.leases_outstanding == 0
    assert after.redelivered_total == before.leases_outstanding - (after.sampled_total - before.sampled_total
                                                                   - cfg.groups_per_step)  # fmt: skip
    # max_times_sampled=1: every acked use removed its group; nothing lost: acked or still stored
    assert after.evicted_total.get("max_times_sampled", 0) == after.sampled_total
    assert after.sampled_total + after.size == after.inserted_total
    buf.close()


def test_resume_keeps_the_checkpoints_version_and_weights_when_newer_ones_were_published(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    """Published v4 is newer than checkpoint v2: the resumed learner is v2 with v2's weights, and it
    re-publishes them as v2 (before the fix it took the number 4 for v2's weights: mislabelled data)."""
    cfg = config(
        tiny_dir,
        redis_url,
        tmp_path,
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": None},
    )
    behaviour = load_model(tiny_dir, "cpu").eval()
    store = PolicyStore(redis_url, cfg.run_id)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(make_groups(behaviour, 16, version=0, temperature=0.9))
    learner = Learner(cfg)
    try:
        learner.step(), learner.step()
        _, version = learner.checkpoint()
        at_checkpoint = {k: v.clone() for k, v in learner.model.state_dict().items()}
        learner.step(), learner.step()
    finally:
        learner.close()
    assert (version, store.read().version) == (2, 4)
    resumed = Learner(cfg)
    try:
        assert resumed.version == 2
        resumed.writer.flush()  # the first publish goes through the background writer too
        record = store.read()
        assert record.version == 2 and Path(record.weights_uri).name == "v2"
        published = load_model(record.weights_uri, "cpu").state_dict()
        for k, v in at_checkpoint.items():
            torch.testing.assert_close(published[k], v, rtol=0, atol=0)
    finally:
        resumed.close()
    store.close()


def test_kill_9_during_a_background_write_leaves_no_partial_version_or_checkpoint(redis_url, tmp_path):
    """A learner whose writes take a while (a 27M-parameter model, weights and checkpoint every step) is
    killed -9 while a temporary folder exists: every visible version matches its manifest, the newest
    checkpoint loads, and a new learner removes the leftovers and resumes from it."""
    model_dir = make_tiny_model(tmp_path / "model", hidden_size=512, num_heads=8, num_layers=6)
    cfg = config(
        model_dir, redis_url, tmp_path, groups_per_step=1, micro_batch_size=4,
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 1, "keep_checkpoints": 2},
        publish={"weights_dir": str(tmp_path / "weights"), "keep_versions": 3},
    )  # fmt: skip
    behaviour = load_model(model_dir, "cpu").eval()
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(make_groups(behaviour, 40, version=0, n=2, tokens=4, temperature=0.9))
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "cfg.json")], cwd=ROOT, env=env)
    caught = None
    try:
        deadline = time.monotonic() + 180
        while caught is None:
            assert child.poll() is None, "the learner subprocess died"
            assert time.monotonic() < deadline, "never saw a write in progress"
            if checkpoint_versions(tmp_path / "ckpt"):
                for folder in (tmp_path / "weights", tmp_path / "ckpt"):
                    tmp = (
                        [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]
                        if folder.is_dir()
                        else []
                    )
                    if tmp:
                        child.send_signal(signal.SIGKILL)
                        caught = (folder.name, tmp)
                        break
            time.sleep(0.002)
    finally:
        child.kill()
        child.wait(timeout=30)
    for version in published_versions(tmp_path / "weights"):
        folder = tmp_path / "weights" / f"v{version}"
        manifest = read_manifest(folder)
        assert manifest["sha256"] == weights_sha256(folder)
        for name, entry in manifest["files"].items():
            assert (folder / name).stat().st_size == entry["bytes"]
    newest = checkpoint_versions(tmp_path / "ckpt")[-1]
    learner = Learner(cfg)
    try:
        assert learner.version == newest
        leftovers = [
            p for d in ("weights", "ckpt") for p in (tmp_path / d).iterdir() if p.name.startswith(".")
        ]
        assert leftovers == [], (caught, leftovers)
        learner.step()
    finally:
        learner.close()
