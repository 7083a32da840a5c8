"""Two experiments on the same deployment volumes: the learner configured by the compose and Kubernetes
environment (weights and checkpoints under `<volume>/{run_id}`) starts a second run beside the first
instead of refusing the first run's checkpoint; with the old fixed folders it would crash-loop."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from buffer.replay_buffer import ReplayBuffer
from deploy.checks import ROOT, SERVICE_CONFIGS, interpolate, load_compose, read_env_file
from learner.config import load_config
from learner.errors import CheckpointMismatch
from learner.persist.checkpoint import checkpoint_versions
from learner.persist.weights import published_versions
from learner.trainer import Learner
from tests.integration.test_learner_fixes import covering_groups
from tests.integration.test_learner_loop import tiny_dir  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.slow]
VOLUMES = "/var/lib/offpolicy"


def compose_learner_env(volumes: Path, run_id: str, **extra: str) -> dict[str, str]:
    """The learner service's environment from docker-compose.yml and .env.example, its volumes moved
    under `volumes` (what the named volumes are on the host)."""
    secrets = {"OFFPOLICY_API_TOKEN": "t", "REDIS_PASSWORD": "p", "GRAFANA_ADMIN_PASSWORD": "g"}
    values = read_env_file(ROOT / ".env.example") | secrets | {"OFFPOLICY_RUN_ID": run_id}
    service = interpolate(load_compose(ROOT / "docker-compose.yml"), values)["services"]["learner"]
    env = {k: str(v).replace(VOLUMES, str(volumes)) for k, v in service["environment"].items()}
    return env | extra


def start_and_train(env: dict[str, str], redis_url: str, tiny: Path) -> Learner:
    """A learner configured by `env` over configs/learner.yaml (CPU, the tiny model), one step trained."""
    cfg = load_config(SERVICE_CONFIGS["learner"], env).model_copy(
        update={"model_path": str(tiny), "device": "cpu", "redis_url": redis_url, "groups_per_step": 2}
    )
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(covering_groups(2, seed=11))
    learner = Learner(cfg)
    learner.step()
    learner.checkpoint()
    learner.writer.flush()
    return learner


def test_a_new_run_id_starts_beside_the_old_run_on_the_same_volumes(tiny_dir, redis_url, tmp_path):  # noqa: F811
    volumes = tmp_path / "volumes"
    runs = [f"exp-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    for run_id in runs:
        learner = start_and_train(compose_learner_env(volumes, run_id), redis_url, tiny_dir)
        learner.close()
    for run_id in runs:  # each run's weights and checkpoints in its own folder on the shared volumes
        assert published_versions(volumes / "weights" / run_id), run_id
        assert checkpoint_versions(volumes / "checkpoints" / run_id), run_id


def test_the_old_fixed_folders_refuse_the_second_run(tiny_dir, redis_url, tmp_path):  # noqa: F811
    """What the deployments did before: one checkpoint folder for every run id (the test above can fail)."""
    volumes = tmp_path / "volumes"
    fixed = {"OFFPOLICY_CHECKPOINT__CHECKPOINT_DIR": str(volumes / "checkpoints")}
    first = start_and_train(
        compose_learner_env(volumes, f"a-{uuid.uuid4().hex[:6]}", **fixed), redis_url, tiny_dir
    )
    first.close()
    with pytest.raises(CheckpointMismatch, match="was written for run"):
        start_and_train(
            compose_learner_env(volumes, f"b-{uuid.uuid4().hex[:6]}", **fixed), redis_url, tiny_dir
        )
