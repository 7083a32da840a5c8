"""End to end with a multi-turn environment: the quickstart's stack (embedded Redis, learner and actor
services, real vLLM on CPU) on the guessing game: three policy turns with the user's replies between them,
the replies attended but not trained. The reward rises."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from buffer.embedded import EmbeddedRedis
from learner.model import make_tiny_model
from services.children import start_service
from services.quickstart import actor_config, learner_config

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]
STEPS = 12


def test_the_guessing_game_learns(tmp_path: Path) -> None:
    from actors.toy import write_target_token_dataset

    model = str(make_tiny_model(tmp_path / "model"))
    dataset = write_target_token_dataset(tmp_path / "dataset.jsonl")
    steps_file = tmp_path / "learner_steps.jsonl"
    with EmbeddedRedis.start(tmp_path / "redis") as redis:
        learner_yaml, actor_yaml = tmp_path / "learner.yaml", tmp_path / "actor.yaml"
        learner_yaml.write_text(yaml.safe_dump(learner_config(tmp_path, model, redis.url, "env")))
        actor_yaml.write_text(
            yaml.safe_dump(
                actor_config(model, dataset, redis.url, "env", "actors.environments.guessing_game")
            )
        )
        learner = start_service("learner", learner_yaml, tmp_path / "learner.log")
        actor = start_service("actor", actor_yaml, tmp_path / "actor.log")
        try:
            learner.wait_ready(timeout_s=180)
            actor.wait_ready(timeout_s=300)
            deadline = time.monotonic() + 400
            while len(lines := steps_file.read_text().splitlines() if steps_file.exists() else []) < STEPS:
                assert time.monotonic() < deadline, actor.log_tail()
                time.sleep(0.5)
            status = httpx.get(f"{learner.url}/v1/status", timeout=10).json()
        finally:
            codes = actor.stop(), learner.stop()
        assert all(code in (0, -signal.SIGTERM) for code in codes), codes
    steps = [json.loads(line) for line in lines]
    rewards = [s["reward_mean"] for s in steps]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, rewards
    assert status["policy_version"] >= STEPS
