"""Health that tells the truth, with the real Learner, a tiny model and a real redis-server:

- Redis stopped for ~10 s under a running learner service: `/readyz` 503 (the learner says it is waiting
  for Redis), `/healthz` 200 throughout, and after a restart on the same port and data dir the loop steps
  again by itself;
- a learner service (child process) whose loop dies of a non-transient error: `/healthz` 503 with the
  reason in `/v1/status`, and the process exits with `EXIT_LOOP_FAILED` after its grace period.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.children import start_service
from offpolicy.services.common.background import EXIT_LOOP_FAILED
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.integration.services.test_learner import random_group

pytestmark = pytest.mark.redis
TINY = {"hidden_size": 64, "num_heads": 1, "num_layers": 1, "intermediate_size": 128}


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", **TINY)


def _config(tiny: Path, redis_url: str, tmp_path: Path, **kw) -> LearnerConfig:
    base = {
        "model_path": str(tiny),
        "device": "cpu",
        "redis_url": redis_url,
        "run_id": f"health-{uuid.uuid4().hex[:8]}",
        "groups_per_step": 2,
        "micro_batch_size": 8,
        "buffer": {"max_staleness": None, "storage_timeout_s": 1.0},
        "sample_timeout_s": 0.5,
        "publish": {"weights_dir": str(tmp_path / "weights")},
        "checkpoint": {"checkpoint_dir": None},
    }
    return LearnerConfig.model_validate(base | kw)


def test_redis_outage_is_not_ready_but_alive_and_the_loop_resumes(tiny: Path, tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path / "redis") as redis:
        config = _config(tiny, redis.url, tmp_path)
        producer = ReplayBuffer(redis.url, config.run_id, BufferConfig(storage_timeout_s=1.0))
        app = create_app(LearnerServiceSettings(), config=config)
        with TestClient(app) as client:
            learner = app.state.runtime.learner
            for i in range(2):
                producer.insert(random_group(0, i))
            wait_for(lambda: learner.step_count >= 1)
            # v1's policy record reaches Redis in the background; the outage starts after it (else the
            # loop's reason would be the failed write of v1, also retried, but another message)
            wait_for(lambda: learner.persist.published_version == learner.version)
            assert client.get("/readyz").status_code == 200

            redis.stop()
            down_at, health = time.monotonic(), []
            while time.monotonic() - down_at < 10.0:
                health.append(client.get("/healthz").status_code)
                time.sleep(0.25)
            assert set(health) == {200}
            assert learner.state == "waiting_for_redis"
            assert app.state.runtime.loop.running
            ready = client.get("/readyz")
            assert ready.status_code == 503
            checks = ready.json()["error"]["detail"]["checks"]
            assert checks["learner"].startswith("learner waiting_for_redis: StorageUnavailable")
            assert checks["redis"].startswith("redis at redis://127.0.0.1:")

            redis.restart()
            steps_before = learner.step_count
            for i in range(2):
                producer.insert(random_group(0, 100 + i))
            wait_for(lambda: learner.step_count > steps_before, timeout_s=30)
            wait_for(lambda: client.get("/readyz").status_code == 200, timeout_s=10)
            assert learner.retrying is None
            assert client.get("/healthz").status_code == 200
        producer.close()


def test_a_dead_loop_exits_the_process_non_zero_after_the_grace(
    tiny: Path, redis_url: str, tmp_path: Path
) -> None:
    config = _config(tiny, redis_url, tmp_path)
    (tmp_path / "learner.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {"OFFPOLICY_FATAL_EXIT_GRACE_S": "3", "OFFPOLICY_LOG_LEVEL": "warning"}
    service = start_service("learner", tmp_path / "learner.yaml", tmp_path / "learner.log", env=env)
    try:
        service.wait_ready(timeout_s=120)  # v0 is published: the weights folder is not touched until v1
        shutil.rmtree(tmp_path / "weights")
        (tmp_path / "weights").write_text("a file where the weights folder should be")
        with ReplayBuffer(redis_url, config.run_id, config.buffer) as producer:
            for i in range(4):  # the first step's publish of v1 fails; the next step raises it
                producer.insert(random_group(0, i))
        wait_for(lambda: httpx.get(f"{service.url}/healthz").status_code == 503, timeout_s=60)
        body = httpx.get(f"{service.url}/healthz").json()["error"]
        assert body["code"] == "loop_failed"
        assert "FileExistsError" in body["detail"]["reason"]
        status = httpx.get(f"{service.url}/v1/status").json()
        assert status["state"] == "failed"
        assert "FileExistsError" in status["error"]
        assert service.proc.wait(timeout=60) == EXIT_LOOP_FAILED, service.log_tail()
    finally:
        service.stop()
