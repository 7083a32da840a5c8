"""`offpolicy quickstart --delta` end to end, as a user runs it: embedded Redis, the learner and actor
services, real vLLM on CPU. The learner writes most versions as their changes (`publish.delta: on`, one
whole every 10), the actor builds each full version from the one it holds before loading it, and the
reward rises (the command's own verdict: exit 0 only when it has)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


# On the 2-core development machine: reward 0.011 over the first 3 steps -> 0.436 over the last 5 at step
# 10; the actor built 13 versions from deltas.
def test_the_quickstart_learns_with_delta_versions(tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [
        sys.executable, "-m", "offpolicy.services.cli", "quickstart", "--delta", "--max-steps", "30",
        "--runs-dir", str(tmp_path), "--timeout-s", "480",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "reward ROSE" in done.stdout, done.stdout[-2000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    bases = {
        int(p.name[1:]): json.loads((p / "manifest.json").read_text()).get("base")
        for p in (run / "weights").iterdir()
        if p.name.startswith("v")
    }
    assert any(b is not None for b in bases.values()), bases  # delta versions on the volume
    # The newest version's chain (each delta's base, down to a full version) stays on the volume. Versions
    # need not be consecutive: a step whose write the next one overtook is coalesced, never written.
    link = max(bases)
    while bases[link] is not None:
        assert bases[link] < link and bases[link] in bases, bases
        link = bases[link]
    assert link == max(v for v, b in bases.items() if b is None), bases  # its root: the newest full version
    built = [
        json.loads(line)["msg"]
        for line in (run / "actor.log").read_text().splitlines()
        if "built from" in line
    ]
    assert built, "the actor loaded no delta version"
    loaded = [p.name for p in (run / "actor-delta").glob("*/v*")]
    assert len(loaded) <= 1, loaded  # the copy of the version the engine held, nothing else left behind
