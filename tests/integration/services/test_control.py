"""`control.mode: auto` in the learner service with the real Learner, a tiny model and the embedded Redis:
the bound the controller sets reaches the buffer (the learner's table and the producers that follow it),
`/v1/status`, `/v1/config/history`, the step records and `/metrics`; a PATCH back to `fixed` restores the
given bound at the next step boundary; no group is lost or trained twice meanwhile."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.integration.services.test_learner import random_group, wait_for

pytestmark = pytest.mark.redis
TOKEN = "control-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def service(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, run_id: str, tmp_path: Path
) -> Iterator[tuple[TestClient, ReplayBuffer]]:
    tiny = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    buffer_cfg = BufferConfig(max_staleness=8, max_times_sampled=1)
    config = LearnerConfig(
        model_path=str(tiny), device="cpu", redis_url=redis_url, run_id=run_id, groups_per_step=2,
        micro_batch_size=8, buffer=buffer_cfg, sample_timeout_s=0.5,
        rollout_correction="decoupled_token_is",  # reports the IS ESS the controller judges
        # an ESS floor no random behaviour policy meets: every window halves the bound, 8 -> 4 -> 2 -> 1
        control={"mode": "auto", "min_staleness": 1, "max_staleness": 8, "ess_floor": 0.99, "window": 1},
        publish={"weights_dir": str(tmp_path / "weights")}, checkpoint={"checkpoint_dir": None},
        metrics_jsonl=str(tmp_path / "steps.jsonl"),
    )  # fmt: skip
    producer = ReplayBuffer(redis_url, run_id, buffer_cfg)  # follows the learner's table (a producer)
    app = create_app(LearnerServiceSettings(api_token=TOKEN), config=config)
    with TestClient(app) as client:
        yield client, producer
    producer.close()


def test_auto_bound_reaches_buffer_status_history_and_a_patch_to_fixed_restores_it(
    service: tuple[TestClient, ReplayBuffer], tmp_path: Path, run_id: str
) -> None:
    client, producer = service
    inserted = 0

    def feed(groups: int) -> None:
        nonlocal inserted
        version = client.get("/v1/status").json()["policy_version"]
        for _ in range(groups):
            producer.insert(random_group(version, inserted))  # random behaviour log-probs: a low ESS
            inserted += 1

    def control() -> dict:
        return client.get("/v1/status").json()["control"]

    feed(2)
    wait_for(lambda: client.get("/v1/status").json()["step"] >= 1)
    assert control()["state"] == "auto" and control()["given_max_staleness"] == 8
    for _ in range(3):  # each step's low ESS halves the bound at the next boundary
        step = client.get("/v1/status").json()["step"]
        feed(2)
        wait_for(lambda s=step: client.get("/v1/status").json()["step"] > s)
    wait_for(lambda: control()["staleness_bound"] == 1)
    status = client.get("/v1/status").json()
    assert [(c["old"], c["new"], c["reason"]) for c in status["control"]["changes"]] == [
        (None, 8, "start"), (8, 4, "ess_below_floor"), (4, 2, "ess_below_floor"), (2, 1, "ess_below_floor"),
    ]  # fmt: skip
    assert status["control"]["judged"]["ess"] < 0.99
    history = client.get("/v1/config/history").json()
    assert [e["config_version"] for e in history["entries"]] == [0]  # the controller makes no config version
    assert [c["new"] for c in history["control"]] == [8, 4, 2, 1]
    assert client.get("/v1/config").json()["config"]["buffer"]["max_staleness"] == 8  # the given value
    metrics = client.get("/metrics").text
    assert f'offpolicy_learner_max_staleness_steps{{run_id="{run_id}"}} 1.0' in metrics
    assert f'offpolicy_learner_control_auto{{run_id="{run_id}"}} 1.0' in metrics
    assert (
        f'offpolicy_learner_control_changes_total{{reason="ess_below_floor",run_id="{run_id}"}} 3.0'
        in metrics
    )
    # the producers follow the learner's table: an insert re-reads it (at most once a second)
    time.sleep(1.1)
    feed(2)
    assert producer.config.max_staleness == 1
    wait_for(lambda: client.get("/v1/status").json()["buffer"]["size"] == 0)

    # one PATCH switches it off; the given bound is back at the next step boundary
    r = client.patch("/v1/config", json={"control": {"mode": "fixed"}}, headers=AUTH)
    assert r.status_code == 202
    feed(2)
    wait_for(lambda: control()["state"] == "fixed")
    assert control()["staleness_bound"] == 8 and control()["changes"][-1]["reason"] == "mode_fixed"
    step = client.get("/v1/status").json()["step"]
    feed(2)
    wait_for(lambda: client.get("/v1/status").json()["step"] > step)
    metrics = client.get("/metrics").text
    assert f'offpolicy_learner_max_staleness_steps{{run_id="{run_id}"}} 8.0' in metrics
    assert f'offpolicy_learner_control_auto{{run_id="{run_id}"}} 0.0' in metrics
    time.sleep(1.1)
    feed(2)
    assert producer.config.max_staleness == 8

    # the step records: the bound each step trained under, none once fixed; every group trained once
    wait_for(lambda: client.get("/v1/status").json()["buffer"]["size"] == 0)
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    bounds = [r.get("control/staleness_bound") for r in lines]
    assert bounds[:4] == [8.0, 4.0, 2.0, 1.0] and bounds[-1] is None
    stats = client.get("/v1/status").json()["buffer"]
    assert stats["sampled_total"] == inserted == 2 * len(lines)
    assert stats["dropped_total"] == {} and stats["redelivered_total"] == 0
