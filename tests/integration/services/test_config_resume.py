"""Config that survives restarts: a learner service (child process, tiny model, embedded Redis) gets a
PATCHed learning rate and rollout-correction preset, checkpoints, is killed with SIGKILL and restarted on the
same files. With `checkpoint.resume_config: checkpoint` (the default) it trains with the PATCHed values and
`GET /v1/config` shows them; with `file` the file's values win. The history says which, with source
`resume` and the fields where the file disagreed."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.services.children import start_service
from tests.integration.services.test_health import TINY, wait_for
from tests.integration.services.test_learner import random_group

pytestmark = [pytest.mark.redis, pytest.mark.slow]
FILE_LR, PATCHED_LR = 1e-4, 5e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from offpolicy.learner.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", **TINY)


def _write_config(tiny: Path, redis_url: str, tmp_path: Path, rule: str) -> tuple[LearnerConfig, Path]:
    config = LearnerConfig.model_validate(
        {
            "model_path": str(tiny),
            "device": "cpu",
            "redis_url": redis_url,
            "run_id": f"resume-{uuid.uuid4().hex[:8]}",
            "groups_per_step": 2,
            "micro_batch_size": 8,
            "optimizer": {"lr": FILE_LR},
            "buffer": {"max_staleness": None},
            "sample_timeout_s": 0.5,
            "publish": {"weights_dir": str(tmp_path / "weights")},
            "checkpoint": {
                "checkpoint_dir": str(tmp_path / "ckpt"),
                "checkpoint_every": None,
                "resume_config": rule,
            },
        }
    )
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return config, path


def _train_one_step(url: str, producer: ReplayBuffer, seed: int) -> dict:
    """Insert a step's groups and wait until the learner trained them; the status after it."""
    step = httpx.get(f"{url}/v1/status").json()["step"]
    for i in range(2):
        producer.insert(random_group(0, seed + i))
    wait_for(lambda: httpx.get(f"{url}/v1/status").json()["step"] > step, timeout_s=60)
    return httpx.get(f"{url}/v1/status").json()


@pytest.mark.parametrize("rule", ["checkpoint", "file"])
def test_patched_lr_and_preset_survive_kill_9_unless_the_file_wins(
    tiny: Path, redis_url: str, tmp_path: Path, rule: str
) -> None:
    config, path = _write_config(tiny, redis_url, tmp_path, rule)
    producer = ReplayBuffer(redis_url, config.run_id, config.buffer)
    service = start_service(
        "learner", path, tmp_path / "learner-1.log", env={"OFFPOLICY_LOG_LEVEL": "warning"}
    )
    try:
        service.wait_ready(timeout_s=120)
        url = service.url
        assert _train_one_step(url, producer, 0)["last_step"]["lr"] == pytest.approx(FILE_LR)
        patch = {"optimizer": {"lr": PATCHED_LR}, "rollout_correction": "decoupled_seq_is"}
        r = httpx.patch(f"{url}/v1/config", json=patch)
        assert r.status_code in (200, 202), r.text
        patched = r.json()["config"]["rollout_correction"]
        assert patched != config.rollout_correction.model_dump(mode="json")  # the preset changes fields
        # applied at the next step boundary (the idle loop's next sample timeout), then a step trains
        wait_for(lambda: httpx.get(f"{url}/v1/status").json()["config_version"] == 1, timeout_s=30)
        status = _train_one_step(url, producer, 10)
        assert status["config_version"] == 1 and status["last_step"]["lr"] == pytest.approx(PATCHED_LR)
        assert httpx.post(f"{url}/v1/checkpoints", timeout=60).status_code == 201
        service.proc.send_signal(signal.SIGKILL)
        service.proc.wait(30)
    finally:
        service.stop()

    service = start_service(
        "learner", path, tmp_path / "learner-2.log", env={"OFFPOLICY_LOG_LEVEL": "warning"}
    )
    try:
        service.wait_ready(timeout_s=120)
        url = service.url
        running = httpx.get(f"{url}/v1/config").json()["config"]
        history = httpx.get(f"{url}/v1/config/history").json()["entries"]
        status = _train_one_step(url, producer, 20)
    finally:
        service.stop()
        producer.close()
    assert [e["source"] for e in history] == ["initial", "resume"]
    resume = history[-1]
    assert resume["config_version"] == 1 and status["config_version"] == 1
    assert {"optimizer.lr", "rollout_correction.rollout_is"} <= set(resume["changed_fields"])
    assert f"checkpoint.resume_config: {rule}" in resume["detail"]
    if rule == "checkpoint":  # the API says what the optimizer uses: the PATCHed values
        assert running["optimizer"]["lr"] == PATCHED_LR
        assert running["rollout_correction"] == patched
        assert status["last_step"]["lr"] == pytest.approx(PATCHED_LR)
    else:  # the file wins, for the optimizer too (the checkpoint's restored scheduler is re-aligned)
        assert running["optimizer"]["lr"] == FILE_LR
        assert running["rollout_correction"] == config.rollout_correction.model_dump(mode="json")
        assert status["last_step"]["lr"] == pytest.approx(FILE_LR)
