"""Running `offpolicy quickstart` as a user does, for the e2e tests of its variants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quickstart(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`offpolicy quickstart FLAGS --max-steps 30` under `tmp_path` (vLLM on CPU, 1 GiB of KV cache), which
    must exit 0 with the reward risen; returns the finished process and its run folder."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [
        sys.executable, "-m", "offpolicy.services.cli", "quickstart", *flags, "--max-steps", "30",
        "--runs-dir", str(tmp_path), "--timeout-s", "480",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "reward ROSE" in done.stdout, done.stdout[-2000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return done, run
