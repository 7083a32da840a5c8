"""`offpolicy fetch-model`: a folder needs nothing, a hub id goes into the cache with the files the
learner and vLLM read, a failure is said and exits 1 (compose then starts nothing on that model)."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest

from offpolicy.services.cli import main
from offpolicy.services.cli.fetch import PATTERNS


def test_a_folder_needs_nothing(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("downloaded"))
    assert main(["fetch-model", str(tmp_path)]) == 0
    assert "a folder here, nothing to fetch" in capsys.readouterr().out


def test_a_hub_id_is_fetched_with_weights_configs_and_tokenizer_files(tmp_path: Path, capsys, monkeypatch):
    calls = []

    def download(repo_id: str, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setenv("OFFPOLICY_MODEL_PATH", "Qwen/Qwen2.5-7B-Instruct")
    assert main(["fetch-model"]) == 0  # the services' variable names the model
    assert calls == [("Qwen/Qwen2.5-7B-Instruct", {"allow_patterns": PATTERNS})]
    assert {"*.safetensors", "*.json", "*.jinja"} <= set(PATTERNS)
    assert f"in the cache at {tmp_path / 'snapshot'}" in capsys.readouterr().out


def test_a_failure_says_why_and_exits_1(capsys, monkeypatch):
    def refuse(repo_id: str, **kwargs):
        raise OSError("401 Client Error: gated repo")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    assert main(["fetch-model", "meta-llama/Llama-3.1-8B"]) == 1
    assert "cannot fetch it into the cache: OSError: 401 Client Error: gated repo" in capsys.readouterr().err
    monkeypatch.delenv("OFFPOLICY_MODEL_PATH", raising=False)
    assert main(["fetch-model"]) == 2
