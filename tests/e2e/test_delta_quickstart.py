"""`offpolicy quickstart --delta` end to end, as a user runs it: embedded Redis, the learner and actor
services, real vLLM on CPU. The learner writes most versions as their changes (`publish.delta: on`, one
whole every 10), the actor builds each full version from the one it holds before loading it, and the
reward rises (the command's own verdict: exit 0 only when it has)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.quickstart_run import run_quickstart

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]


# On the 2-core development machine: reward 0.011 over the first 3 steps -> 0.436 over the last 5 at step
# 10; the actor built 13 versions from deltas.
def test_the_quickstart_learns_with_delta_versions(tmp_path: Path) -> None:
    _, run = run_quickstart(tmp_path, "--delta")
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
