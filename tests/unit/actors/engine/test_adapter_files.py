"""The engine's copy of a LoRA adapter's folder (`hold_files`): vLLM reads it again whenever the adapter is
not in its cache, so it must outlive the learner's pruning of the published folder."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from offpolicy.actors.engine.lora_serving import hold_files


def test_the_engines_copy_of_an_adapter_outlives_the_published_folder(tmp_path: Path, monkeypatch):
    """`hold_files` (the real one): hard links on one filesystem, copies where links fail; either way
    the learner's pruning of the published folder leaves the engine's copy whole; a folder already gone is
    an `OSError` that leaves nothing behind."""
    src = tmp_path / "w" / "v3"
    (src / "sub").mkdir(parents=True)
    (src / "adapter_model.safetensors").write_bytes(b"\x01" * 1000)
    (src / "adapter_config.json").write_text('{"r": 8}')
    (src / "sub" / "x").write_text("y")
    hold_files(src, tmp_path / "linked")
    assert os.stat(tmp_path / "linked" / "adapter_model.safetensors").st_nlink == 2  # no bytes written

    def no_links(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    hold_files(src, tmp_path / "copied")
    assert os.stat(tmp_path / "copied" / "adapter_model.safetensors").st_nlink == 1
    shutil.rmtree(src)  # the learner prunes the version
    for held in ("linked", "copied"):
        assert (tmp_path / held / "adapter_model.safetensors").read_bytes() == b"\x01" * 1000
        assert (tmp_path / held / "adapter_config.json").read_text() == '{"r": 8}'
        assert (tmp_path / held / "sub" / "x").read_text() == "y"
    with pytest.raises(OSError):
        hold_files(src, tmp_path / "gone")
    assert not (tmp_path / "gone").exists()
