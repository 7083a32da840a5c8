"""`offpolicy quickstart --task vision` end to end, as a user runs it: embedded Redis, the learner and actor
services, real vLLM on CPU serving a tiny Qwen2.5-VL. Each prompt shows a PNG of a coloured square; its
image goes through the chat template to the engine, into the buffer (stored once), to the learner's image
processor and forward; the reward (the share of the colour's letter) rises (the command's own verdict: exit
0 only when it has), and the engine survives its weight updates with images in flight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.quickstart_run import run_quickstart

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]


# On the 2-core development machine: reward 0.014 over the first 3 steps -> 0.142 over the last 5 at step 12.
def test_the_vision_quickstart_learns(tmp_path: Path) -> None:
    _, run = run_quickstart(tmp_path, "--task", "vision")
    loaded = [
        json.loads(line)["msg"]
        for line in (run / "actor.log").read_text().splitlines()
        if "loaded policy v" in line
    ]
    assert len(loaded) >= 2, "the actor took no weight update while generating"
    assert "Encoder cache miss" not in (run / "actor.log").read_text()
