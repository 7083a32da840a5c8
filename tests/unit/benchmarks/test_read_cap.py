"""benchmarks/weight_sync.py --read-mb-s: the cap really slows the volume's cold reads (and is lifted after),
and a volume with no block device is refused with a message. Each case runs in a child process: the cap
moves the process that sets it into a cgroup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
CHILD = """
import os, time
from pathlib import Path
from weight_sync import cap_reads

def cold_read(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    while os.read(fd, 8 << 20):
        pass
    os.close(fd)
    return time.perf_counter() - t0

path = Path({path!r})
undo = cap_reads(path.parent, {mb_s})
capped = cold_read(path)
undo()
print(capped, cold_read(path))
"""


def _child(path: Path, mb_s: float) -> subprocess.CompletedProcess[str]:
    code = CHILD.format(path=str(path), mb_s=mb_s)  # `-c` in benchmarks/: its modules by file name
    return subprocess.run(
        [sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True, timeout=60
    )


def test_the_cap_slows_cold_reads_of_the_volume_and_is_lifted(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    with path.open("wb") as f:
        f.write(os.urandom(48 << 20))
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED drops them
    done = _child(path, 64)
    if done.returncode != 0 and "--read-mb-s" in done.stderr:
        pytest.skip(f"no writable cgroup block-I/O controller here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    capped, uncapped = map(float, done.stdout.split())
    assert capped >= 0.5, (capped, uncapped)  # 50 MB at 64 MB/s: ~0.79 s
    assert uncapped < capped / 2, (capped, uncapped)


def test_a_volume_without_a_block_device_is_refused() -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    done = _child(Path("/dev/shm/none"), 64)
    assert done.returncode != 0
    assert "not on a block device" in done.stderr, done.stderr
