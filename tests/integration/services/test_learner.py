"""The learner service in-process with the real Learner, a tiny model and the embedded Redis."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app

pytestmark = pytest.mark.redis
TOKEN = "integration-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def random_group(version: int, seed: int, n: int = 4, tokens: int = 6) -> TrajectoryGroup:
    """A valid group for the tiny char model (ids 4..99); rewards differ so advantages are non-zero."""
    rng = np.random.default_rng(seed)
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex,
        prompt_id=f"p{seed}",
        prompt_ids=rng.integers(4, 100, 5, dtype=np.int32),
        policy_version=version,
        actor_id="test",
        created_at=time.time(),
        sampling=SamplingParams(temperature=1.0, max_tokens=tokens),
        trajectories=[
            Trajectory(
                response_ids=rng.integers(4, 100, tokens, dtype=np.int32),
                behavior_logprobs=(-4.6 - 0.1 * rng.random(tokens)).astype(np.float32),
                reward=float(i) / n,
                finish_reason="length",
            )
            for i in range(n)
        ],
    )


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def service(
    tiny: Path, redis_url: str, run_id: str, tmp_path: Path
) -> Iterator[tuple[TestClient, ReplayBuffer]]:
    buffer_cfg = BufferConfig(max_staleness=4, max_times_sampled=1)
    config = LearnerConfig(
        model_path=str(tiny),
        device="cpu",
        redis_url=redis_url,
        run_id=run_id,
        groups_per_step=2,
        micro_batch_size=8,
        buffer=buffer_cfg,
        sample_timeout_s=0.5,
        publish={"weights_dir": str(tmp_path / "weights")},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": None},
        metrics_jsonl=str(tmp_path / "steps.jsonl"),
    )
    producer = ReplayBuffer(redis_url, run_id, buffer_cfg)
    app = create_app(LearnerServiceSettings(api_token=TOKEN), config=config)
    with TestClient(app) as client:
        yield client, producer
    producer.close()


def feed(producer: ReplayBuffer, client: TestClient, groups: int, seed: int) -> None:
    version = client.get("/v1/status").json()["policy_version"]
    for i in range(groups):
        producer.insert(random_group(version, seed * 100 + i))


def config_info(client: TestClient) -> list[dict[str, str]]:
    """The labels of the `offpolicy_learner_config_info` series /metrics exports (one: the running config)."""
    families = text_string_to_metric_families(client.get("/metrics").text)
    return [s.labels for f in families if f.name == "offpolicy_learner_config_info" for s in f.samples]


def test_steps_config_patch_history_metrics_checkpoint(
    service: tuple[TestClient, ReplayBuffer], tmp_path: Path, run_id: str
) -> None:
    client, producer = service
    steps_jsonl = tmp_path / "steps.jsonl"
    assert client.get("/readyz").status_code == 200
    feed(producer, client, 4, seed=1)
    wait_for(lambda: client.get("/v1/status").json()["step"] >= 2)
    status = client.get("/v1/status").json()
    assert status["policy_version"] >= 2
    assert status["buffer"]["sampled_total"] == 4
    assert "reward_mean" in status["last_step"]
    # the memory plan's choices: on CPU without a limit, no checkpointing and the configured budgets;
    # `compile_layers: auto` is off on CPU
    assert status["settings"] == {
        "gradient_checkpointing": False, "checkpointed_layers": 0, "decoder_layers": 2,
        "micro_batch_tokens": 16384, "no_grad_micro_batch_tokens": 16384, "compile_layers": False,
    }  # fmt: skip

    # pause at a boundary, change the config, nothing applies while paused
    assert client.post("/v1/pause", headers=AUTH).json()["state"] == "paused"
    r = client.patch(
        "/v1/config",
        json={"rollout_correction": "decoupled_seq_is", "clip_ratio_high": 0.28},
        headers=AUTH,
    )
    assert r.status_code == 202
    assert r.json()["status"] == "pending"
    assert set(r.json()["changed_fields"]) >= {"clip_ratio_high", "rollout_correction.rollout_is"}
    step_before = client.get("/v1/status").json()["step"]
    assert client.get("/v1/config").json()["config_version"] == 0
    assert config_info(client) == [{"config_version": "0", "preset": "disabled", "run_id": run_id}]

    # invalid and unauthenticated PATCHes change nothing
    bad = client.patch("/v1/config", json={"clip_ratio_low": 1.5}, headers=AUTH)
    assert bad.status_code == 422
    assert bad.json()["error"]["detail"][0]["field"] == "body.clip_ratio_low"
    assert client.patch("/v1/config", json={"clip_ratio_high": 0.1}).status_code == 401
    frozen = client.patch("/v1/config", json={"model_path": "/elsewhere"}, headers=AUTH)
    assert frozen.status_code == 409
    assert frozen.json()["error"]["detail"] == {"fields": ["model_path"]}

    # resume: the change lands at the next step boundary (a step already waiting in `sample` when the
    # pause came may still finish with the old config: the learner reports the exact boundary)
    client.post("/v1/resume", headers=AUTH)
    feed(producer, client, 2, seed=2)
    wait_for(lambda: client.get("/v1/config").json()["config_version"] == 1)
    running = client.get("/v1/config").json()
    assert running["config"]["rollout_correction"]["rollout_is"] == "sequence"
    boundary = running["applied_at_step"]
    assert boundary in (step_before, step_before + 1)
    feed(producer, client, 2, seed=3)
    wait_for(lambda: client.get("/v1/status").json()["step"] > boundary)
    wait_for(lambda: client.get("/v1/status").json()["last_step"].get("config_version") == 1.0)
    lines = [json.loads(line) for line in steps_jsonl.read_text().splitlines()]
    assert [(int(r["step"]), r["config_version"]) for r in lines if r["step"] <= boundary + 1] == [
        *((i, 0.0) for i in range(1, boundary + 1)),
        (boundary + 1, 1.0),
    ]
    history = client.get("/v1/config/history").json()["entries"]
    assert [e["config_version"] for e in history] == [0, 1]
    metrics = client.get("/metrics").text  # every sample of the run labelled with its id
    assert f'offpolicy_learner_config_version{{run_id="{run_id}"}} 1.0' in metrics
    assert f'offpolicy_learner_max_staleness_steps{{run_id="{run_id}"}} 4.0' in metrics
    assert config_info(client) == [{"config_version": "1", "preset": "decoupled_seq_is", "run_id": run_id}]
    assert "offpolicy_learner_rollout_corr_rollout_is_seq_mean" in metrics

    # on-demand checkpoint, with no step in flight (else one may finish between it and the status read)
    wait_for(
        lambda: (
            (s := client.get("/v1/status").json())["state"] == "waiting_for_data" and s["buffer"]["size"] == 0
        )
    )
    ckpt = client.post("/v1/checkpoints", headers=AUTH)
    assert ckpt.status_code == 201
    assert Path(ckpt.json()["path"]).exists()
    assert ckpt.json()["policy_version"] == client.get("/v1/status").json()["policy_version"]

    # a learner waiting for data is paused all the same when asked (and says so), then resumes
    assert client.get("/v1/status").json()["state"] == "waiting_for_data"
    assert client.post("/v1/pause", headers=AUTH).json()["state"] == "paused"
    assert client.get("/v1/status").json()["state"] == "paused"
    assert client.post("/v1/resume", headers=AUTH).json()["state"] in ("running", "waiting_for_data")
