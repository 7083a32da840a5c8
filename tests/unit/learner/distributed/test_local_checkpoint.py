"""The lean start reads safetensors slices from a folder: a hub id as `model_path` is resolved to its
snapshot in the local Hugging Face cache first (here offline, from a cache laid out as the hub client
writes it); a hub id with no snapshot is an error that names it, never a silent whole-model load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from offpolicy.learner.distributed.lean import local_checkpoint
from offpolicy.learner.model import make_tiny_model

ROOT = Path(__file__).resolve().parents[4]


def resolve(name: str, cache: Path) -> subprocess.CompletedProcess:
    # a child process: the hub client reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported
    code = (
        "import sys\nfrom offpolicy.learner.distributed.lean import local_checkpoint\n"
        "print(local_checkpoint(sys.argv[1]))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, name], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_folder_is_used_as_it_is(tmp_path):
    folder = make_tiny_model(tmp_path / "m", hidden_size=64, num_heads=1, num_layers=1)
    assert local_checkpoint(str(folder)) == Path(folder)


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    make_tiny_model(snapshot, hidden_size=64, num_heads=1, num_layers=1)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    run = resolve("acme/tiny", cache)
    assert run.returncode == 0, run.stderr[-2000:]
    resolved = Path(run.stdout.strip())
    assert resolved == snapshot and sorted(p.name for p in resolved.glob("*.safetensors"))


def test_a_hub_id_without_a_snapshot_is_refused_by_name(tmp_path):
    run = resolve("acme/absent", tmp_path / "empty")
    assert run.returncode != 0
    assert "FileNotFoundError" in run.stderr and "'acme/absent'" in run.stderr
