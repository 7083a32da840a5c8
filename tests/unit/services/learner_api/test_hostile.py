"""Hostile requests to the learner's control plane (hermetic fake learner): each answers 4xx and changes
nothing; no response of any route shows the Redis password or the API token."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from offpolicy.learner.config import LearnerConfig
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.unit.services.learner_api.test_routes import FakeLearner

TOKEN = "tok-9f8e7d6c5b4a"
PASSWORD = "redis-pw-1a2b3c4d"
REDIS_URL = f"redis://:{PASSWORD}@127.0.0.1:1/0"
AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}


def _client(tmp_path: Path, factory=FakeLearner, **settings) -> TestClient:
    config = LearnerConfig(
        model_path="/models/tiny", redis_url=REDIS_URL, metrics_jsonl=str(tmp_path / "m.jsonl")
    )
    app = create_app(
        LearnerServiceSettings(api_token=TOKEN, **settings), config=config, learner_factory=factory
    )
    return TestClient(app)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with _client(tmp_path) as c:
        yield c


def _unchanged(client: TestClient) -> None:
    assert len(client.get("/v1/config/history").json()["entries"]) == 1
    assert client.app.state.runtime.learner.pending is None


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"optimizer": {"lr": Infinity}}', "body.optimizer.lr"),
        ('{"optimizer": {"lr": -Infinity}}', "body.optimizer.lr"),
        ('{"optimizer": {"lr": NaN}}', "body.optimizer.lr"),
        ('{"optimizer": {"lr": 1e309}}', "body.optimizer.lr"),
        ('{"optimizer": {"lr": "inf"}}', "body.optimizer.lr"),
        ('{"optimizer": {"lr": true}}', "body.optimizer.lr"),
        ('{"optimizer": {"lr": -1e-5}}', "body.optimizer.lr"),
        ('{"optimizer": {"lr": 0}}', "body.optimizer.lr"),
        ('{"optimizer": {"betas": [0.9, Infinity]}}', "body.optimizer.betas.1"),
        ('{"clip_ratio_high": NaN}', "body.clip_ratio_high"),
        ('{"grad_clip": 1e999}', "body.grad_clip"),
        ('{"sample_timeout_s": 0}', "body.sample_timeout_s"),
        ('{"groups_per_step": 0}', "body.groups_per_step"),
        ('{"groups_per_step": -3}', "body.groups_per_step"),
        ('{"groups_per_step": true}', "body.groups_per_step"),
        ('{"ppo_epochs": 1.5}', "body.ppo_epochs"),
        ('{"groups_per_step": 1000000000}', "body.groups_per_step"),  # the bounds: a run's share, timeouts
        ('{"groups_per_step": 18446744073709551616}', "body.groups_per_step"),
        ('{"micro_batch_tokens": 18446744073709551616}', "body.micro_batch_tokens.constrained-int"),
        ('{"sample_timeout_s": 1e300}', "body.sample_timeout_s"),
        ('{"ppo_epochs": 1000000000}', "body.ppo_epochs"),
        ('{"publish": {"keep_versions": 1000000000}}', "body.publish.keep_versions"),
        ('{"buffer": {"max_size": 18446744073709551616}}', "body.buffer.max_size"),
        ('{"buffer": {"dedupe_window": 1000000000000}}', "body.buffer.dedupe_window"),
        ('{"max_steps": 18446744073709551616}', "body.max_steps"),
        ('{"run_id": "../x"}', "body.run_id"),
        ('{"buffer": {"max_size": -1}}', "body.buffer.max_size"),
        ('{"buffer": {"priority_epsilon": Infinity}}', "body.buffer.priority_epsilon"),
        ('{"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": Infinity}}',
         "body.rollout_correction.rollout_is_threshold"),
        ('{"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "1e309"}}',
         "body.rollout_correction.rollout_is_threshold"),
        ('{"rollout_correction": {"rollout_token_veto_threshold": true}}',
         "body.rollout_correction.rollout_token_veto_threshold"),
        ('{"metrics_jsonl": "/tmp/' + "x" * 300 + '.jsonl"}', "body.metrics_jsonl"),
        ('{"metrics_jsonl": "/tmp/' + "x/" * 2100 + '"}', "body.metrics_jsonl"),
        ('{"metrics_jsonl": "/proc/offpolicy/steps.jsonl"}', "body.metrics_jsonl"),
        ('{"metrics_jsonl": "/tmp"}', "body.metrics_jsonl"),
    ],
)  # fmt: skip
def test_hostile_values_are_422_on_their_field_and_change_nothing(client: TestClient, raw: str, field: str):
    for method, url in [("PATCH", "/v1/config"), ("POST", "/v1/config/validate?mode=merge")]:
        r = client.request(method, url, content=raw, headers=AUTH)
        assert r.status_code == 422, (method, raw, r.text)
        assert r.json()["error"]["code"] == "validation_error"
        assert field in [d["field"] for d in r.json()["error"]["detail"]], r.text
    _unchanged(client)


def test_a_5_mb_path_is_413_by_default_and_422_under_a_larger_limit(tmp_path: Path) -> None:
    body = json.dumps({"metrics_jsonl": "/tmp/" + "a" * 5_000_000})
    with _client(tmp_path) as client:
        r = client.patch("/v1/config", content=body, headers=AUTH)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"
        _unchanged(client)
    with _client(tmp_path, max_body_bytes=8 * 1024 * 1024) as client:
        r = client.patch("/v1/config", content=body, headers=AUTH)
        assert r.status_code == 422
        assert r.json()["error"]["detail"][0]["field"] == "body.metrics_jsonl"
        _unchanged(client)


def test_oversized_bodies_are_413_with_or_without_a_content_length(client: TestClient) -> None:
    big = b'{"ppo_epochs": 2, "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    r = client.patch("/v1/config", content=big, headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")
    pieces = iter([big[i : i + 65536] for i in range(0, len(big), 65536)])  # no Content-Length: chunked
    chunked = client.patch("/v1/config", content=pieces, headers=AUTH)
    assert (chunked.status_code, chunked.json()["error"]["code"]) == (413, "payload_too_large")
    assert client.post("/v1/config/validate?mode=merge", content=big, headers=AUTH).status_code == 413
    _unchanged(client)


def test_a_writable_new_metrics_path_is_accepted(client: TestClient, tmp_path: Path) -> None:
    r = client.patch(
        "/v1/config", json={"metrics_jsonl": str(tmp_path / "new" / "dir" / "m.jsonl")}, headers=AUTH
    )
    assert r.status_code == 202, r.text
    assert r.json()["changed_fields"] == ["metrics_jsonl"]


def test_a_config_round_trip_keeps_the_real_password(client: TestClient) -> None:
    shown = client.get("/v1/config").json()["config"]
    assert shown["redis_url"] == "redis://:***@127.0.0.1:1/0"
    r = client.put("/v1/config", json={**shown, "ppo_epochs": 2}, headers=AUTH)
    assert r.status_code == 202, r.text
    assert r.json()["changed_fields"] == ["ppo_epochs"]
    assert client.app.state.runtime.control.newest().config.redis_url == REDIS_URL
    assert client.app.state.runtime.learner.pending[0].redis_url == REDIS_URL
    assert client.patch("/v1/config", json={"redis_url": shown["redis_url"]}, headers=AUTH).status_code == 202
    other = client.patch("/v1/config", json={"redis_url": "redis://:guess@127.0.0.1:1/0"}, headers=AUTH)
    assert other.status_code == 409
    assert client.app.state.runtime.control.newest().config.redis_url == REDIS_URL


def _every_response(client: TestClient) -> list:
    shown = client.get("/v1/config").json()["config"]
    requests = [
        ("GET", "/healthz", None, {}), ("GET", "/readyz", None, {}), ("GET", "/metrics", None, {}),
        ("GET", "/openapi.json", None, {}), ("GET", "/docs", None, {}),
        ("GET", "/v1/config", None, {}), ("GET", "/v1/config/history", None, {}),
        ("GET", "/v1/presets", None, {}), ("GET", "/v1/presets/token_is", None, {}),
        ("GET", "/v1/presets/nope", None, {}), ("GET", "/v1/status", None, {}), ("GET", "/nope", None, {}),
        ("POST", "/v1/config/validate?mode=merge", {"ppo_epochs": 2}, {}),
        ("POST", "/v1/config/validate", shown, {}),
        ("POST", "/v1/config/validate?mode=merge", {"redis_url": "x" * 5000}, {}),
        ("POST", "/v1/config/validate?mode=merge", {"seed": 3}, {}),
        ("PATCH", "/v1/config", {"ppo_epochs": 3}, AUTH), ("PUT", "/v1/config", shown, AUTH),
        ("PATCH", "/v1/config", {"optimizer": {"lr": True}}, AUTH),
        ("PATCH", "/v1/config", {"ppo_epochs": 3}, {"Authorization": "Bearer wrong"}),
        ("PATCH", "/v1/config", {"redis_url": "redis://:other@h/0"}, AUTH),
        ("POST", "/v1/pause", None, AUTH), ("POST", "/v1/resume", None, AUTH),
        ("POST", "/v1/checkpoints", None, AUTH),
        ("GET", "/v1/config/history", None, {}),
    ]  # fmt: skip
    return [client.request(m, u, json=b, headers=h) for m, u, b, h in requests]


def _assert_no_secret(responses: list) -> None:
    for r in responses:
        text = r.text + json.dumps(dict(r.headers))
        assert PASSWORD not in text, (r.request.method, r.request.url, text[:300])
        assert TOKEN not in text, (r.request.method, r.request.url, text[:300])


def test_no_route_shows_the_password_or_the_token(client: TestClient) -> None:
    responses = _every_response(client)
    assert {r.status_code for r in responses} >= {200, 202, 401, 404, 409, 422, 503}
    _assert_no_secret(responses)
    assert "redis://:***@127.0.0.1:1/0" in client.get("/readyz").text


class LeakyLearner(FakeLearner):
    """A loop that dies with the Redis URL (password included) in its error message."""

    def run(self, stop_event: threading.Event) -> None:
        raise RuntimeError(f"cannot reach {self.config.redis_url} (token {TOKEN})")


def test_a_loop_error_carrying_secrets_is_scrubbed_everywhere(tmp_path: Path) -> None:
    with _client(tmp_path, factory=LeakyLearner) as client:
        deadline = time.monotonic() + 5
        while client.app.state.runtime.loop.running and time.monotonic() < deadline:
            time.sleep(0.01)
        status = client.get("/v1/status").json()
        assert status["state"] == "failed"
        assert "cannot reach redis://:***@127.0.0.1:1/0" in status["error"]
        _assert_no_secret(_every_response(client))


def test_log_lines_are_scrubbed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from offpolicy.services.common.logging import configure_logging

    with _client(tmp_path) as client:
        configure_logging("info", True, client.app.state.redactor)
        import logging

        try:
            raise RuntimeError(f"AUTH {PASSWORD} failed")
        except RuntimeError:
            logging.getLogger("x").exception("redis %s with token %s", REDIS_URL, TOKEN)
    err = capsys.readouterr().err
    assert "redis redis://:***@127.0.0.1:1/0 with token ***" in err
    assert "AUTH *** failed" in err
    assert PASSWORD not in err and TOKEN not in err
