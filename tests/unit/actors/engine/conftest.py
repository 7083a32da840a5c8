"""The engine's tests share a stand-in for the engine's copy of an adapter's folder: the stand-in LLM's
adapters are named by paths that do not exist (`/w/v1`); the copy records which folder it stands for."""

from __future__ import annotations

from pathlib import Path

import pytest

from offpolicy.actors.engine import lora_serving


def source(lora_request) -> str:
    """The folder an adapter registered with the stand-in was copied from."""
    return (Path(lora_request.lora_path) / "source").read_text()


@pytest.fixture
def stand_in_adapter_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hold_files` makes the engine's folder and records the path it was asked to copy."""

    def hold(src, dest: Path) -> None:
        dest.mkdir(parents=True)
        (dest / "source").write_text(str(src))

    monkeypatch.setattr(lora_serving, "hold_files", hold)
