"""Two experiments on the same deployment volumes: two learner services (child processes, `offpolicy
learner`), each with the environment docker-compose.yml gives the learner and its own OFFPOLICY_RUN_ID,
on the same weights / checkpoints / logs folders. Both start and train side by side, each in
`<volume>/<run id>`; the first one restarted resumes its own checkpoint. With the fixed folders the
deployments used before, the second run refuses the first run's checkpoint (the crash loop)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from deploy.checks import ROOT, SERVICE_CONFIGS, interpolate, load_compose, read_env_file
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.persist.version_folders import published_versions
from offpolicy.services.children import ServiceProcess, start_service
from offpolicy.services.common.errors import ChildProcessFailed
from tests.integration.services.test_health import TINY, wait_for
from tests.integration.services.test_learner import random_group

pytestmark = [pytest.mark.redis, pytest.mark.slow]
VOLUMES = "/var/lib/offpolicy"
TOKEN = f"token-{uuid.uuid4().hex}"  # the logs mask it: a short one would mask every letter it holds


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from offpolicy.learner.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", **TINY)


def compose_learner_env(volumes: Path, run_id: str, tiny: Path, redis_url: str) -> dict[str, str]:
    """The learner service's environment from docker-compose.yml and .env.example with `run_id`, the
    container paths under /var/lib/offpolicy moved under `volumes` (what the named volumes are on the
    host); the tiny model on CPU and the test's Redis in place of the GPU model and the `redis` service."""
    secrets = {
        "OFFPOLICY_API_TOKEN": TOKEN,
        "OFFPOLICY_GATEWAY_TOKEN": "gw",
        "REDIS_PASSWORD": "pw",
        "GRAFANA_ADMIN_PASSWORD": "gp",
    }
    values = read_env_file(ROOT / ".env.example") | secrets | {"OFFPOLICY_RUN_ID": run_id}
    service = interpolate(load_compose(ROOT / "docker-compose.yml"), values)["services"]["learner"]
    env = {k: str(v).replace(VOLUMES, str(volumes)) for k, v in service["environment"].items()}
    assert env["OFFPOLICY_RUN_ID"] == run_id
    return env | {
        "OFFPOLICY_MODEL_PATH": str(tiny),
        "OFFPOLICY_DEVICE": "cpu",
        "OFFPOLICY_REDIS_URL": redis_url,
        "OFFPOLICY_GROUPS_PER_STEP": "2",
        "OFFPOLICY_SAMPLE_TIMEOUT_S": "0.5",
        "OFFPOLICY_API_TOKEN": TOKEN,
        "OFFPOLICY_LOG_LEVEL": "warning",
    }


def start(env: dict[str, str], log: Path) -> ServiceProcess:
    service = start_service("learner", SERVICE_CONFIGS["learner"], log, env=env)
    try:
        service.wait_ready(timeout_s=180)
    except BaseException:
        service.stop()
        raise
    return service


def train_and_checkpoint(service: ServiceProcess, redis_url: str, run_id: str, seed: int) -> int:
    """Insert one step's groups into `run_id`'s buffer, wait for the step, checkpoint; the version."""
    with ReplayBuffer(redis_url, run_id) as producer:
        for i in range(2):
            producer.insert(random_group(0, seed + i))
    wait_for(lambda: httpx.get(f"{service.url}/v1/status").json()["step"] >= 1, timeout_s=120)
    r = httpx.post(f"{service.url}/v1/checkpoints", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 201, r.text
    return httpx.get(f"{service.url}/v1/status").json()["policy_version"]


def test_two_run_ids_on_the_same_volumes_both_start_and_train(tiny, redis_url, tmp_path):
    volumes = tmp_path / "volumes"
    runs = [f"exp-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    envs = [compose_learner_env(volumes, run_id, tiny, redis_url) for run_id in runs]
    services: list[ServiceProcess] = []
    try:
        for k, (run_id, env) in enumerate(zip(runs, envs, strict=True)):
            services.append(start(env, tmp_path / f"learner-{k}.log"))  # the first one still runs
            assert train_and_checkpoint(services[-1], redis_url, run_id, seed=10 * k) >= 1
    finally:
        for service in services:
            service.stop()
    for run_id in runs:  # each run's weights, checkpoints and metrics in its own folder
        assert published_versions(volumes / "weights" / run_id), run_id
        assert checkpoint_versions(volumes / "checkpoints" / run_id), run_id
        assert (volumes / "logs" / run_id / "learner_metrics.jsonl").stat().st_size > 0, run_id
    # the first run restarted resumes its own checkpoint, next to the second run's
    again = start(envs[0], tmp_path / "learner-0-again.log")
    try:
        status = httpx.get(f"{again.url}/v1/status").json()
    finally:
        again.stop()
    assert status["policy_version"] >= 1, "the restarted run did not resume its checkpoint"


def test_the_old_fixed_folders_refuse_the_second_run(tiny, redis_url, tmp_path):
    """What the deployments did before (one checkpoint folder for every run id): the second run's learner
    exits at start (the crash loop), so the test above can fail."""
    volumes = tmp_path / "volumes"
    fixed = {"OFFPOLICY_CHECKPOINT__CHECKPOINT_DIR": str(volumes / "checkpoints")}
    runs = [f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"]
    first = start(compose_learner_env(volumes, runs[0], tiny, redis_url) | fixed, tmp_path / "a.log")
    try:
        train_and_checkpoint(first, redis_url, runs[0], seed=0)
    finally:
        first.stop()
    with pytest.raises(ChildProcessFailed, match=r"CheckpointMismatch: .* was written for run"):
        second = start(compose_learner_env(volumes, runs[1], tiny, redis_url) | fixed, tmp_path / "b.log")
        second.stop()
