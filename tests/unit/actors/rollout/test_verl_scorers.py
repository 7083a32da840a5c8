"""A reward module written for verl, `from verl.utils.reward_score import gsm8k`, scores through the actor's
reward path with verl installed without its dependencies (`pip install --no-deps verl==0.9.1`, as `make
install` and the images' `REWARD_PACKAGES_NO_DEPS` do): `import verl` needs Ray, its scorers do not.

Each case runs in a fresh interpreter: a bare `verl` in `sys.modules` would leak into other tests."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None, reason="verl's sources (make install puts them there)"
)
ROOT = Path(__file__).resolve().parents[4]

MODULES = {
    "verl_gsm8k_reward.py": """
        from verl.utils.reward_score import gsm8k


        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return gsm8k.compute_score(solution_str, ground_truth)
    """,
    "verl_default_reward.py": """
        from verl.utils.reward_score import default_compute_score as compute_score  # noqa: F401
    """,
    "verl_protocol_reward.py": """
        from verl.protocol import DataProto  # noqa: F401  (Ray's world: not a scorer)


        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0
    """,
    "own_missing_reward.py": """
        import a_package_nobody_has  # noqa: F401


        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0
    """,
}

SCRIPT = """
import asyncio, json, sys
from offpolicy.actors.config import RewardConfig
from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.rollout.scoring import Scorer

out = {}
prompt = Prompt(index=0, prompt_id="p0", text="48 + 24?", answer="72",
                metadata={"data_source": "openai/gsm8k", "extra_info": "{}"})
for module in sys.argv[1:]:
    try:
        scorer = Scorer(RewardConfig(name=module + ".compute_score"))
    except ValueError as e:
        out[module] = {"error": str(e)}
        continue
    try:
        out[module] = {"scores": asyncio.run(scorer.score(prompt, ["so #### 72", "#### 70", "72"]))}
    finally:
        scorer.close()
out["bare"] = bool(getattr(sys.modules.get("verl"), "__offpolicy_bare__", False))
print(json.dumps(out))
"""


def run(tmp_path: Path, *modules: str) -> dict:
    for name, source in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *modules], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_verl_scorers_score_through_the_actor_without_ray(tmp_path: Path) -> None:
    out = run(tmp_path, "verl_gsm8k_reward", "verl_default_reward")
    assert out["verl_gsm8k_reward"] == {"scores": [1.0, 0.0, 0.0]}  # verl's gsm8k: strict, after `####`
    assert out["verl_default_reward"] == {"scores": [1.0, 0.0, 0.0]}  # chosen by data_source openai/gsm8k
    assert out["bare"] is True


def test_a_module_needing_more_of_verl_names_what_verl_lacked(tmp_path: Path) -> None:
    out = run(tmp_path, "verl_protocol_reward")
    error = out["verl_protocol_reward"]["error"]
    assert "cannot import 'compute_score' from 'verl_protocol_reward'" in error
    assert "verl's package needs" in error and "install verl with its dependencies" in error


def test_a_reward_missing_its_own_package_is_not_touched(tmp_path: Path) -> None:
    out = run(tmp_path, "own_missing_reward")
    assert "No module named 'a_package_nobody_has'" in out["own_missing_reward"]["error"]
    assert "verl" not in out["own_missing_reward"]["error"] and out["bare"] is False
