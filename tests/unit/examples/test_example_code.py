"""The example reward module of docs/deploy.md's walk-through loads the way a deployment loads it: its folder
on PYTHONPATH, `reward.name: my_rewards.score`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = Path(__file__).resolve().parents[3] / "examples" / "code"


def test_the_example_reward_resolves_from_its_folder_on_pythonpath():
    program = (
        "from offpolicy.actors.rollout.rewards import resolve_reward\n"
        "fn = resolve_reward('my_rewards.score')\n"
        "print(fn('so it is 12', '12', {}), fn('it is 13', '12', {}), fn('no idea', '12', {}))\n"
    )
    env = {"PYTHONPATH": f"{CODE}:{Path(__file__).resolve().parents[3]}"}
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1.0", "0.1", "0.0"]
