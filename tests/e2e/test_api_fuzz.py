"""Fuzz the learner service's API from its own OpenAPI spec (schemathesis): no request makes it answer 5xx,
and no response (nor the log) shows the Redis password or the API token.

The learner runs as a real child process (tiny model, embedded Redis with a password, no actor: its loop
waits for data), with a token configured; the fuzzer sends the token, so mutating routes are exercised
past the auth check.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.children import ServiceProcess, start_service

pytestmark = [pytest.mark.slow, pytest.mark.redis]
TOKEN = "fuzz-token-5e1c"
PASSWORD = "fuzz-redis-pw-77a9"
EXAMPLES = int(os.environ.get("OFFPOLICY_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def learner_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    model = make_tiny_model(root / "model")
    with EmbeddedRedis.start(root / "redis", password=PASSWORD) as redis:
        config = {
            "model_path": str(model),
            "device": "cpu",
            "redis_url": redis.url,
            "run_id": f"fuzz-{uuid.uuid4().hex[:8]}",
            "publish": {"weights_dir": str(root / "weights")},
            "checkpoint": {"checkpoint_dir": str(root / "ckpt"), "checkpoint_every": None},
        }
        (root / "learner.yaml").write_text(yaml.safe_dump(config))
        env = {"OFFPOLICY_API_TOKEN": TOKEN, "OFFPOLICY_LOG_LEVEL": "warning"}
        service = start_service("learner", root / "learner.yaml", root / "learner.log", env=env)
        try:
            service.wait_ready(timeout_s=120)
            yield service
        finally:
            assert service.stop() in (0, -signal.SIGTERM), service.log_tail()


def test_no_server_errors(learner_service: ServiceProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{learner_service.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            response = case.call(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            case.validate_response(response, checks=[not_a_server_error])
            shown = response.text + str(dict(response.headers))
            assert PASSWORD not in shown and TOKEN not in shown, (case.method, case.path, shown[:300])

        fuzz()


def test_log_has_no_tracebacks_and_no_secrets(learner_service: ServiceProcess) -> None:
    log = Path(learner_service.log_path).read_text()
    assert "Traceback" not in log
    assert PASSWORD not in log and TOKEN not in log
