"""benchmarks/staleness.py in miniature: forced staleness is exact, and `--json` has the documented shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offpolicy.actors.data.toy import write_target_token_dataset
from staleness import Setup, run_arm

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[3]
TINY = Setup(steps=5, groups_per_step=2, n=2, max_new_tokens=4)


@pytest.mark.parametrize("arm", ["naive", "decoupled_token_is"])
def test_learner_trains_at_step_t_only_on_groups_of_version_t_minus_eta(arm, redis_url, tmp_path):
    write_target_token_dataset(tmp_path / "prompts.jsonl", num_prompts=8, target="a", seed=0)
    eta = 2
    trace = run_arm(arm, eta, 0, TINY, redis_url, tmp_path)  # raises if a step leaves groups unsampled
    assert trace.trained_versions == [0, 0, 0, 1, 2]  # t - eta; the initial weights (version 0) for t < eta
    # The learner's own staleness metric (its version t minus the trained groups' policy_version).
    assert trace.staleness == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert len(trace.rewards) == len(trace.kl) == TINY.steps
    assert len(trace.ess) == (TINY.steps if arm == "decoupled_token_is" else 0)


def test_json_output_has_the_documented_shape(tmp_path):
    png = tmp_path / "staleness.png"
    cmd = [sys.executable, "benchmarks/staleness.py", "--json", "--steps", "2", "--seeds", "0",
           "--etas", "2", "--arms", "naive", "--plot", str(png)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert set(out) == {"arms", "lr", "seeds"} and out["seeds"] == [0] and out["lr"] > 0
    keys = {
        "arm",
        "eta",
        "final_reward_mean",
        "final_reward_std",
        "steps_to_threshold",
        "ess_mean",
        "kl_mean",
    }
    assert [set(row) for row in out["arms"]] == [keys, keys]
    assert [(row["arm"], row["eta"]) for row in out["arms"]] == [("sync", 0), ("naive", 2)]
    assert all(0.0 <= row["final_reward_mean"] <= 1.0 for row in out["arms"])
    assert all(row["ess_mean"] is None for row in out["arms"])  # neither arm has IS weights
    assert png.stat().st_size > 0
