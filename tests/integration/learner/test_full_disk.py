"""A full disk for real: the learner's weights and checkpoint folders on a small tmpfs that fills up mid-run
(a filler file takes the space), the learner in a subprocess on a queue buffer. While the volume is full,
steps go on up to the durability cap (`checkpoint.max_undurable_steps`), failures are counted and no
partial version is visible; the learner is killed with `kill -9` in the spell, the space comes back, and a
restarted learner trains every remaining group: every inserted group is trained exactly once in the
history the final weights descend from, no lease is left, nothing is lost. Needs a tmpfs mount (root with
CAP_SYS_ADMIN); skipped otherwise (tests/integration/learner/test_write_faults.py injects the error)."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.persist.version_folders import published_versions, version_dir
from offpolicy.weights.manifest import file_sha256, read_manifest
from tests.integration.learner.test_delivery import CHILD, ROOT, step_lines, train_to_the_end
from tests.integration.learner.test_loop import config, covering_groups, tiny_dir  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def volume(tmp_path):
    """A 24 MiB tmpfs (its own filesystem: filling it fills nothing else)."""
    mount = tmp_path / "vol"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Take every free byte of `folder`'s filesystem with one file; returns it."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 20, 4096, 1):  # whole MiB, then the rest
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def steps_of(path: Path) -> list[dict]:
    return [line for line in step_lines(path) if "group_ids" in line]


def test_a_full_volume_is_back_pressure_and_kill_9_in_the_spell_loses_nothing(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
    volume,
):
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, micro_batch_size=8, sample_timeout_s=2.0,
        buffer={"sampler": "fifo", "max_times_sampled": 1},
        publish={"weights_dir": str(volume / "weights"), "keep_versions": 2},
        checkpoint={"checkpoint_dir": str(volume / "ckpt"), "checkpoint_every": 2, "keep_checkpoints": 1,
                    "max_undurable_steps": 10},
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        groups = covering_groups(120, seed=3, n=2, tokens=4)
        assert buf.insert_many(groups).ok
    inserted = {g.group_id for g in groups}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = tmp_path / "steps-0.jsonl"
    (tmp_path / "cfg-0.json").write_text(
        cfg.model_copy(update={"metrics_jsonl": str(first)}).model_dump_json()
    )
    log = tmp_path / "learner-0.log"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "cfg-0.json")], cwd=ROOT, env=env,
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(steps_of(first)) < 4 or not checkpoint_versions(volume / "ckpt"):  # a durable checkpoint
            assert child.poll() is None and time.monotonic() < deadline, "the learner made no progress"
            time.sleep(0.05)
        filler = fill(volume)
        full_at = len(steps_of(first))
        deadline = time.monotonic() + 120
        while len(steps_of(first)) < full_at + 3:  # steps go on with the volume full (up to the cap)
            assert child.poll() is None, "the learner died on a full disk"
            assert time.monotonic() < deadline, "the learner stopped stepping on a full disk"
            time.sleep(0.05)
        # the steps go on to the cap, where the intake stops (the loop's warning; state
        # `waiting_for_checkpoint`): exactly `max_undurable_steps` steps past the newest durable checkpoint
        deadline = time.monotonic() + 120
        while not (stopped := re.search(r"intake stopped: (\d+) learner steps .*", log.read_text())):
            assert child.poll() is None, "the learner died on a full disk"
            assert time.monotonic() < deadline, "the intake did not stop at the cap"
            time.sleep(0.05)
        cap = cfg.checkpoint.max_undurable_steps
        assert int(stopped[1]) == cap, stopped[0]
        assert f"(checkpoint.max_undurable_steps = {cap})" in stopped[0], stopped[0]
        durable = checkpoint_versions(volume / "ckpt")[-1]  # one update per step: version = step
        assert steps_of(first)[-1]["step"] == durable + cap, (durable, steps_of(first)[-1]["step"])
        # writes failed for lack of space (a version may still fit later, in what a removed partial
        # write gave back), and the steps went on regardless
        assert "No space left on device" in log.read_text()
        for v in published_versions(volume / "weights"):  # never a partial version
            folder = version_dir(volume / "weights", v)
            manifest = read_manifest(folder)
            assert manifest is not None, f"v{v} has no manifest"
            for name, entry in manifest["files"].items():
                assert file_sha256(folder / name) == entry["sha256"], f"v{v}/{name}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    resumed_first = (checkpoint_versions(volume / "ckpt") or [0])[-1]
    filler.unlink()  # the space comes back
    final = tmp_path / "steps-final.jsonl"
    train_to_the_end(cfg, final)
    trained: Counter[str] = Counter()
    for line in steps_of(first):
        if line["version"] <= resumed_first:
            trained.update(line["group_ids"])
    for line in steps_of(final):
        trained.update(line["group_ids"])
    assert [g for g, n in trained.items() if n > 1] == [], "a group trained twice"
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        stats = buf.stats()
    assert set(trained) == inserted and stats.size == 0  # every group trained once, none lost
    assert stats.leases_outstanding == 0 and stats.acked_total == len(inserted)
    assert not [p for p in (volume / "weights").iterdir() if p.name.startswith(".tmp-")]
