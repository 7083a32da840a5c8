"""A user's code folder first on `PYTHONPATH` (as the images and manifests mount it) holding `config.py`,
`buffer.py`, `learner.py`, `actors.py`, `services.py` and `utils.py`: the CLI, both services and the
quickstart run unchanged, and the user's reward function imports the user's own `config` and `utils`.

The user's `buffer.py`, `learner.py`, `actors.py` and `services.py` raise when imported: nothing of the
project may resolve to them. The reward function records each call in a file its `config.py` names, so
the test sees that the actor ran the user's code with the user's `config`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offpolicy.actors.data.toy import write_target_token_dataset

ROOT = Path(__file__).resolve().parents[2]
SHADOWS = ("buffer", "learner", "actors", "services")


def user_folder(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    marks = tmp_path / "reward_calls.txt"
    (code / "config.py").write_text(f"MARK_FILE = {str(marks)!r}\nTARGET = 'a'\n")
    (code / "utils.py").write_text(
        "import config\n\n\ndef mark(n):\n    with open(config.MARK_FILE, 'a') as fh:\n"
        "        fh.write(f'{n}\\n')\n"
    )
    for name in SHADOWS:
        (code / f"{name}.py").write_text(f"raise ImportError('the user\\'s {name}.py was imported')\n")
    (code / "user_rewards.py").write_text(
        "import config\nimport utils\n\n\ndef target_share(completion, answer, metadata):\n"
        "    utils.mark(len(completion))\n"
        "    return completion.count(config.TARGET) / max(len(completion), 1)\n"
    )
    return code


def env_for(code: Path) -> dict[str, str]:
    # the user's folder first, the project after it (as an installed wheel would be found after it)
    path = os.pathsep.join(filter(None, [str(code), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_the_cli_and_both_services_import_with_the_users_folder_first(tmp_path: Path) -> None:
    code = user_folder(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "offpolicy.services.cli", "--help"],
        cwd=code,
        env=env_for(code),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    probe = (
        "import sys, config, utils\n"
        "import offpolicy.services.learner_api.main, offpolicy.services.actor_api.main\n"
        "import offpolicy.learner.trainer, offpolicy.actors.rollout.actor, offpolicy.weights.engines.plugin\n"
        f"assert not any(name in sys.modules for name in {SHADOWS!r})\n"
        "assert config.TARGET == 'a' and config.__file__.startswith(sys.argv[1])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe, str(code)],
        cwd=code,
        env=env_for(code),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_the_quickstart_runs_the_users_reward_with_the_users_config(tmp_path: Path) -> None:
    code = user_folder(tmp_path)
    dataset = write_target_token_dataset(tmp_path / "prompts.jsonl")
    runs = tmp_path / "runs"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "offpolicy.services.cli",
            "quickstart",
            "--dataset",
            str(dataset),
            "--reward",
            "user_rewards.target_share",
            "--max-steps",
            "3",
            "--runs-dir",
            str(runs),
            "--timeout-s",
            "500",
        ],
        cwd=code,
        env=env_for(code),
        capture_output=True,
        text=True,
        timeout=600,
    )
    # 0: the reward rose within 3 steps; 1: it did not (too few steps to tell). Anything else is a failure.
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    steps = [json.loads(line) for f in runs.glob("*/metrics.jsonl") for line in f.read_text().splitlines()]
    assert len(steps) >= 3, run.stdout[-3000:]
    calls = (tmp_path / "reward_calls.txt").read_text().split()
    assert len(calls) >= 3 * 4, calls  # the actor scored groups with the user's function and config
