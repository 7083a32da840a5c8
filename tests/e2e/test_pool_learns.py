"""End to end: two runs with different targets on one actor pool (embedded Redis, two LoRA learner services
and one actor service serving both runs' adapters on one vLLM engine, real vLLM on CPU, as child
processes): each learner's reward of its own target rises; then one run's learner is killed (SIGKILL) and
the other run goes on training, its actor run generating, while the dead one's run waits (its buffer full)
without holding anything back."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.children import ServiceProcess, start_service
from offpolicy.services.quickstart.configs import actor_config, learner_config

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]

STEPS = 10
TARGETS = {"pool-a": "a", "pool-b": "b"}  # run id -> the character its reward asks for


def steps_of(root: Path, run_id: str) -> list[dict]:
    path = root / run_id / "learner_steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def risen(root: Path, run_id: str) -> bool:
    """The run's mean reward over its last 3 steps is 0.05 above its first 3's (after at least `STEPS`)."""
    rewards = [s["reward_mean"] for s in steps_of(root, run_id)]
    return len(rewards) >= STEPS and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05


def wait_for(cond, timeout_s: float, what: str, *services: ServiceProcess) -> None:
    """Until `cond()`; fails at `timeout_s`, or at once when one of `services` (all meant to live) exited."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        tails = "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in services)
        gone = [f"{s.name} (exit {s.proc.returncode})" for s in services if s.proc.poll() is not None]
        assert not gone, f"{', '.join(gone)} exited while waiting for {what}\n{tails}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{tails}"
        time.sleep(0.5)


def test_two_runs_on_one_actor_both_learn_and_a_dead_learner_leaves_the_other_training(
    tmp_path: Path,
) -> None:
    model = str(make_tiny_model(tmp_path / "model"))
    with EmbeddedRedis.start(tmp_path / "redis") as redis:
        actors = {}
        for run_id, target in TARGETS.items():
            (tmp_path / run_id).mkdir()
            dataset = write_target_token_dataset(tmp_path / run_id / "toy.jsonl", target=target)
            learner = learner_config(tmp_path / run_id, model, redis.url, run_id, lr=3e-2, lora=True)
            (tmp_path / run_id / "learner.yaml").write_text(yaml.safe_dump(learner))
            actors[run_id] = actor_config(model, dataset, redis.url, run_id, lora=True)
        first, second = (actors[r] for r in TARGETS)
        pool = first | {
            "runs": [{k: v for k, v in second.items() if k not in ("model_path", "engine", "runs")}]
        }
        (tmp_path / "actor.yaml").write_text(yaml.safe_dump(pool))
        learners = {
            run_id: start_service(
                "learner", tmp_path / run_id / "learner.yaml", tmp_path / run_id / "learner.log"
            )
            for run_id in TARGETS
        }
        actor = start_service("actor", tmp_path / "actor.yaml", tmp_path / "actor.log")
        services = [actor, *learners.values()]
        try:
            for learner in learners.values():
                learner.wait_ready(timeout_s=180)
            actor.wait_ready(timeout_s=300)
            # each run's own reward rises (asynchronous runs sharing 2 CPU cores: 10 to ~30 steps)
            wait_for(lambda: all(risen(tmp_path, r) for r in TARGETS), 900, "both runs' rewards", *services)
            killed, alive = "pool-b", "pool-a"
            learners[killed].proc.send_signal(signal.SIGKILL)
            learners[killed].proc.wait(30)
            at_kill = len(steps_of(tmp_path, alive))
            wait_for(
                lambda: len(steps_of(tmp_path, alive)) >= at_kill + 4,
                300,
                "the live run's steps",
                actor,
                learners[alive],
            )
            runs = {r["run_id"]: r for r in httpx.get(f"{actor.url}/v1/runs", timeout=10).json()["runs"]}
            health = httpx.get(f"{actor.url}/healthz", timeout=10).status_code
        finally:
            codes = [s.stop() for s in services]
        assert codes[0] in (0, -signal.SIGTERM), (codes, actor.log_tail())
    assert health == 200 and {r: runs[r]["state"] for r in TARGETS} == {r: "running" for r in TARGETS}
    assert runs[alive]["learner_policy_version"] >= at_kill + 3, runs[alive]
    assert runs[alive]["adapter_version"] >= STEPS and runs[killed]["adapter_version"] >= STEPS - 2
