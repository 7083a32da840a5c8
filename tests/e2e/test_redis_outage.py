"""Redis killed -9 for 10 s under a running learner service and actor service (child processes, real
vLLM on CPU, the quickstart's configs): both stay alive (`/healthz` 200 throughout), the learner reports
the outage (`/readyz` 503), and once Redis is back on the same port and data dir both go on by themselves:
the learner steps again and the actor pushes again, neither restarted."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.children import start_service
from offpolicy.services.quickstart.configs import actor_config, learner_config

pytestmark = [pytest.mark.redis, pytest.mark.vllm, pytest.mark.slow]


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5.0)
    except httpx.TransportError:
        return None


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.5)


def test_learner_and_actor_ride_out_a_redis_kill(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path / "redis") as redis:
        model = str(make_tiny_model(tmp_path / "model"))
        dataset = write_target_token_dataset(tmp_path / "dataset.jsonl")
        lcfg = learner_config(tmp_path, model, redis.url, "outage")
        lcfg["buffer"]["storage_timeout_s"] = 2.0
        acfg = actor_config(model, dataset, redis.url, "outage")
        (tmp_path / "learner.yaml").write_text(yaml.safe_dump(lcfg))
        (tmp_path / "actor.yaml").write_text(yaml.safe_dump(acfg))
        learner = start_service("learner", tmp_path / "learner.yaml", tmp_path / "learner.log")
        actor = start_service("actor", tmp_path / "actor.yaml", tmp_path / "actor.log")
        try:
            learner.wait_ready(180)
            actor.wait_ready(300)

            def step() -> int:
                return _get(f"{learner.url}/v1/status").json()["step"]

            def pushed() -> int:
                return _get(f"{actor.url}/v1/status").json()["groups_pushed"]

            _wait(lambda: step() >= 2 and pushed() >= 2, 180, "training before the outage")
            redis.kill()
            down, health, learner_ready = time.monotonic(), set(), set()
            while time.monotonic() - down < 10.0:
                for child in (learner, actor):
                    r = _get(f"{child.url}/healthz")
                    health.add((child.name, None if r is None else r.status_code))
                r = _get(f"{learner.url}/readyz")
                learner_ready.add(None if r is None else r.status_code)
                time.sleep(0.5)
            assert health == {("learner", 200), ("actor", 200)}, health
            assert 503 in learner_ready, learner_ready
            redis.restart()
            steps, groups = step(), pushed()
            _wait(lambda: step() > steps + 1, 120, "learner stepping after the outage")
            _wait(lambda: pushed() > groups + 1, 120, "actor pushing after the outage")
            _wait(lambda: _get(f"{learner.url}/readyz").status_code == 200, 30, "learner ready again")
            assert learner.proc.poll() is None and actor.proc.poll() is None  # never restarted
        finally:
            actor.stop()
            learner.stop()
