"""A full disk at the learner's edges, with the real learner and the embedded Redis: `OSError(ENOSPC)`
injected at the file writes under the weights or the checkpoint folder. Publishing fails for a few steps:
steps keep advancing, failures are counted, no partial version is ever visible, publishing resumes once
the fault is lifted. Checkpoints keep failing: the cap stops intake, training resumes after one lands."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.persist.version_folders import published_versions
from offpolicy.learner.trainer import Learner
from offpolicy.weights import safetensors_io
from offpolicy.weights.manifest import read_manifest
from offpolicy.weights.record import PolicyStore
from tests.integration.learner.test_loop import config, make_groups, tiny_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.redis


class Disk:
    """Fills up on demand: while `full` names a folder, every file write under it fails with ENOSPC."""

    def __init__(self, monkeypatch) -> None:
        self.full: set[Path] = set()
        real_init, real_write = safetensors_io.HashingFile.__init__, safetensors_io.HashingFile.write

        def init(file, path: Path) -> None:
            real_init(file, path)
            file.path = Path(path)

        def write(file, data) -> None:
            if any(file.path.is_relative_to(f) for f in self.full):
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(file, data)

        monkeypatch.setattr(safetensors_io.HashingFile, "__init__", init)
        monkeypatch.setattr(safetensors_io.HashingFile, "write", write)


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _failures(learner: Learner, kind: str) -> float:
    value = learner.metrics.registry.get_sample_value(
        "offpolicy_learner_write_failures_total", {"kind": kind, "reason": "ENOSPC"}
    )
    return value or 0.0


def _complete_versions(weights: Path) -> list[int]:
    """Every version folder an actor may see, each asserted complete (its manifest lists its files); at
    most the one write in flight has a hidden partial folder (a failed one's is removed at once)."""
    assert len([p for p in weights.iterdir() if p.name.startswith(".tmp-")]) <= 1
    versions = published_versions(weights)
    for v in versions:
        manifest = read_manifest(weights / f"v{v}")
        assert manifest is not None, f"v{v} has no manifest"
        for name in manifest["files"]:
            assert (weights / f"v{v}" / name).is_file(), f"v{v}/{name} is missing"
    return versions


@pytest.fixture(scope="module")
def groups(tiny_dir):  # noqa: F811 (the fixture imported above)
    return make_groups(load_model(tiny_dir, "cpu").eval(), 16, version=0, temperature=0.9)


def _learner(cfg) -> Learner:
    learner = Learner(cfg)
    learner.persist.writer.retry_initial_s, learner.persist.writer.retry_max_s = 0.05, 0.2  # quick retries
    return learner


def test_a_full_weights_volume_is_back_pressure_and_publishing_resumes(
    tiny_dir,  # noqa: F811
    groups,
    redis_url,
    tmp_path,
    monkeypatch,
):
    disk = Disk(monkeypatch)
    cfg = config(tiny_dir, redis_url, tmp_path, checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"),
                                                            "checkpoint_every": 2})  # fmt: skip
    weights = tmp_path / "weights"
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = _learner(cfg)
    try:
        learner.writer.flush(10)  # v0 published
        disk.full.add(weights)
        for _ in range(4):  # the weights volume is full: every step trains, publishes fail
            learner.step()
            assert _complete_versions(weights) == [0]
        assert learner.step_count == 4 and learner.version == 4
        _wait(lambda: _failures(learner, "weights") >= 1)
        failing = learner.status()["writes_failing"]["weights"]
        assert failing["reason"] == "ENOSPC" and failing["path"].startswith(str(weights))
        assert failing["bytes_needed"] > 0
        # the same steps' checkpoints were not cancelled by the failed publishes (a healthy volume)
        learner.writer.flush(10, kind="checkpoint")
        assert (tmp_path / "ckpt" / "ckpt-0000000004" / "meta.json").exists()
        disk.full.clear()  # space is back: the newest version is published within the backoff's bound
        _wait(lambda: learner.persist.published_version == 4, timeout_s=5.0)
        assert _complete_versions(weights)[-1] == 4 and learner.status()["writes_failing"] == {}
        assert not [p for p in weights.iterdir() if p.name.startswith(".tmp-")]
        record = PolicyStore(redis_url, cfg.run_id).read()
        assert record is not None and record.version == 4
        assert learner.state != "failed"
    finally:
        learner.close()


def test_the_cap_stops_intake_while_checkpoints_fail_and_training_resumes_when_one_lands(
    tiny_dir,  # noqa: F811
    groups,
    redis_url,
    tmp_path,
    monkeypatch,
):
    disk = Disk(monkeypatch)
    ckpt = tmp_path / "ckpt"
    cfg = config(
        tiny_dir, redis_url, tmp_path,
        checkpoint={"checkpoint_dir": str(ckpt), "checkpoint_every": 1, "max_undurable_steps": 2},
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = _learner(cfg)
    disk.full.add(ckpt)
    stop = threading.Event()
    loop = threading.Thread(target=learner.run, args=(stop,), daemon=True)
    loop.start()
    try:
        _wait(lambda: learner.state == "waiting_for_checkpoint")
        # the reason names the failure once the in-flight write has failed (the loop re-checks every 0.5 s)
        _wait(lambda: "No space left" in (learner.status()["intake_stopped"] or ""))
        status = learner.status()
        assert status["step"] == 2 and status["undurable_steps"] == 2
        assert "max_undurable_steps = 2" in status["intake_stopped"]
        assert status["writes_failing"]["checkpoint"]["path"].startswith(str(ckpt))
        assert status["leases_unacked"] == 2 * cfg.groups_per_step  # nothing trained is acknowledged
        assert learner.retrying is not None  # /readyz 503 with the reason
        time.sleep(0.5)
        assert learner.step_count == 2  # no new groups taken
        assert learner.metrics.registry.get_sample_value("offpolicy_learner_intake_blocked") == 1
        assert _failures(learner, "checkpoint") >= 1
        # a failed try removes its partial folder (one retry may be mid-write at any moment: wait it out)
        _wait(lambda: not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")])
        disk.full.clear()  # a checkpoint lands: its leases are acked, training resumes
        _wait(lambda: learner.step_count >= 4)
        # past the cap: a checkpoint newer than the stopped steps landed (the learner may wait again for
        # the next one's write, a cap of 2 with a checkpoint every step: that is the bound working)
        _wait(lambda: any(v >= 2 for v in checkpoint_versions(ckpt)))
    finally:
        stop.set()
        loop.join(30)
        learner.close()
    assert learner.status()["writes_failing"] == {}
