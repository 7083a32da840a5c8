"""Faults at the writer's edges: a full disk (`OSError(ENOSPC)` injected at the write) is back-pressure,
retried with backoff; one failure never cancels another write; partial folders are removed at once."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from offpolicy.learner.errors import WriteFailed
from offpolicy.learner.persist import file_generation as published_mod
from offpolicy.learner.persist import single as single_mod
from offpolicy.learner.persist.file_generation import WeightsSnapshot, write_version
from offpolicy.learner.persist.single import CheckpointSnapshot, write_checkpoint
from offpolicy.learner.persist.version_folders import published_versions
from offpolicy.learner.persist.writer import BackgroundWriter
from offpolicy.weights import safetensors_io


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


class _Recorder:
    def __init__(self) -> None:
        self.done: list[tuple[str, int]] = []
        self.failed: list[tuple[str, int, int | None]] = []
        self.lock = threading.Lock()

    def on_done(self, kind, version, result, seconds):
        with self.lock:
            self.done.append((kind, version))

    def on_failed(self, kind, version, exc, retry_in_s):
        with self.lock:
            self.failed.append((kind, version, exc.errno))


def _writer(rec: _Recorder, initial: float = 0.05, cap: float = 0.2) -> BackgroundWriter:
    return BackgroundWriter(rec.on_done, rec.on_failed, retry_initial_s=initial, retry_max_s=cap)


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failed_weights_write_does_not_cancel_the_same_steps_checkpoint():
    rec = _Recorder()
    writer = _writer(rec, initial=60.0, cap=60.0)  # the weights write is not retried within the test
    writer.submit("weights", 9, _enospc)
    _wait(lambda: rec.failed)
    writer.submit("checkpoint", 9, lambda: "ckpt-9")  # queued: the earlier failure is not raised here
    assert writer.flush(10, kind="checkpoint")
    assert rec.done == [("checkpoint", 9)]
    assert rec.failed == [("weights", 9, errno.ENOSPC)]
    writer.raise_if_failed()  # a full disk is not a bug: nothing to raise into the loop
    assert set(writer.failing()) == {"weights"}
    with pytest.raises(WriteFailed, match=r"weights write of v9 failed.*No space left"):
        writer.flush(10)  # waiting for every kind: the weights' spell is reported, not waited out
    writer.close(10)


def test_a_failed_checkpoint_does_not_cancel_the_next_weights_write():
    rec = _Recorder()
    writer = _writer(rec, initial=60.0, cap=60.0)
    writer.submit("checkpoint", 4, _enospc)
    writer.submit("weights", 4, lambda: "v4")
    _wait(lambda: ("weights", 4) in rec.done and rec.failed)
    assert rec.failed == [("checkpoint", 4, errno.ENOSPC)] and writer.pending("checkpoint")
    writer.close(10)  # at close the failing checkpoint is tried once more, then dropped
    assert rec.failed == [("checkpoint", 4, errno.ENOSPC)] * 2


def test_a_full_disk_is_retried_with_backoff_and_the_newest_version_lands_once_it_fits():
    rec = _Recorder()
    writer = _writer(rec)
    full = threading.Event()
    full.set()
    wrote: list[int] = []

    def job(v):
        def write():
            if full.is_set():
                _enospc()
            wrote.append(v)

        return write

    writer.submit("weights", 1, job(1))
    _wait(lambda: len(rec.failed) >= 3)  # retried: the same job, again and again
    assert {f[1] for f in rec.failed} == {1}
    writer.submit("weights", 2, job(2))  # replaces v1, which is skipped (never half-written)
    _wait(lambda: any(f[1] == 2 for f in rec.failed))
    full.clear()
    _wait(lambda: rec.done)
    assert wrote == [2] and rec.done == [("weights", 2)]
    assert writer.failing() == {} and writer.flush(10)
    writer.close(10)


def test_the_backoff_doubles_to_its_cap():
    delays: list[float] = []
    writer = BackgroundWriter(
        on_failed=lambda kind, v, exc, delay: delays.append(delay), retry_initial_s=0.01, retry_max_s=0.04
    )
    writer.submit("checkpoint", 1, _enospc)
    _wait(lambda: len(delays) >= 4)
    assert delays[:4] == [0.01, 0.02, 0.04, 0.04]
    writer.close(10)


def test_a_stream_read_once_is_not_retried():
    rec = _Recorder()
    writer = _writer(rec)
    writer.submit("weights", 3, _enospc, retry=False)
    _wait(lambda: rec.failed)
    assert not writer.pending("weights") and set(writer.failing()) == {"weights"}
    writer.close(10)
    assert len(rec.failed) == 1


def _snapshot(version: int) -> WeightsSnapshot:
    from transformers import LlamaConfig

    return WeightsSnapshot(
        version=version,
        tensors={"a": torch.ones(64), "b": torch.zeros(8, 8)},
        config=LlamaConfig(hidden_size=8, num_attention_heads=1, num_hidden_layers=1, vocab_size=16),
        tokenizer=None,
        dtype=torch.float32,
    )


def test_a_version_write_that_meets_a_full_disk_leaves_no_partial_folder(tmp_path, monkeypatch):
    write_version(_snapshot(1), tmp_path)
    real, calls = safetensors_io.HashingFile.write, []

    def fill_up(self, data):
        calls.append(1)
        if len(calls) > 1:  # the header is written, then the disk is full
            _enospc()
        real(self, data)

    monkeypatch.setattr(safetensors_io.HashingFile, "write", fill_up)
    with pytest.raises(OSError) as err:
        write_version(_snapshot(2), tmp_path)
    assert err.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no .tmp-* left, v1 intact
    assert published_versions(tmp_path) == [1]


def test_a_checkpoint_write_that_meets_a_full_disk_leaves_no_partial_folder(tmp_path, monkeypatch):
    copies = {"model": published_mod.HostCopy({"w": torch.ones(4)}, None, pin=False)}
    snap = CheckpointSnapshot(5, copies, {"version": 5})
    monkeypatch.setattr(single_mod, "write_safetensors", _enospc)
    with pytest.raises(OSError):
        write_checkpoint(tmp_path, snap)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert write_checkpoint(tmp_path, snap).name == "ckpt-0000000005"


@pytest.mark.parametrize("code", [errno.EEXIST, errno.ENOTDIR, errno.EACCES])
def test_a_misconfigured_folder_is_not_back_pressure_but_ends_the_loop(code):
    """A file where the folder should be, a permission: no retry heals it; raised into the loop as a bug."""
    rec = _Recorder()
    writer = _writer(rec)

    def misconfigured():
        raise OSError(code, "misconfigured")

    writer.submit("weights", 3, misconfigured)
    _wait(lambda: writer._error is not None)
    with pytest.raises(WriteFailed, match="weights write of v3 failed"):
        writer.raise_if_failed()
    assert rec.failed == [] and writer.failing() == {}
    writer.close(10)
