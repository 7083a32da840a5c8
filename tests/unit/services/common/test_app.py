"""The shared service plumbing: error envelope and table, bearer token, health, readiness, metrics."""

from __future__ import annotations

import json
import logging
import os

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import Counter
from pydantic import BaseModel, Field

from offpolicy.buffer.errors import InvalidTrajectory, RateLimited, StorageUnavailable
from offpolicy.services.common.app import create_service_app
from offpolicy.services.common.auth import Authorized
from offpolicy.services.common.errors import ERROR_TABLE, FieldFrozen, NotFound, status_for
from offpolicy.services.common.logging import JsonFormatter
from offpolicy.services.common.metrics import make_registry
from offpolicy.services.common.settings import ServiceSettings


class Body(BaseModel):
    inner: Inner


class Inner(BaseModel):
    x: int = Field(ge=0)


Body.model_rebuild()


def _app(token: str | None = None, ready: str | None = None) -> FastAPI:
    async def check() -> str | None:
        return ready

    registry = make_registry()
    Counter("offpolicy_test_things_total", "things", registry=registry).inc(3)
    app = create_service_app(
        title="t",
        description="d",
        settings=ServiceSettings(api_token=token),
        registry=registry,
        readiness_checks={"dep": check},
    )

    @app.post("/body", dependencies=[Authorized])
    def body(b: Body) -> dict:
        return {"x": b.inner.x}

    @app.get("/raise/{kind}")
    def raise_(kind: str) -> dict:
        raise {
            "frozen": FieldFrozen("model.path cannot change while running", {"fields": ["model.path"]}),
            "missing": NotFound("no preset 'x'"),
            "traj": InvalidTrajectory("trajectories[0].reward", "not finite"),
            "storage": StorageUnavailable("redis down"),
            "bug": RuntimeError("secret internals"),
        }[kind]

    return app


def test_table_walks_the_mro() -> None:
    class MoreSpecific(RateLimited):
        pass

    assert status_for(MoreSpecific("x")) == (429, "rate_limited")
    assert status_for(KeyError("x")) == (500, "internal_error")
    assert all(100 <= status < 600 for status, _ in ERROR_TABLE.values())


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        ("frozen", 409, "field_frozen"),
        ("missing", 404, "not_found"),
        ("traj", 422, "invalid_trajectory"),
        ("storage", 503, "storage_unavailable"),
        ("bug", 500, "internal_error"),
    ],
)
def test_domain_errors_answer_the_envelope(kind: str, status: int, code: str) -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    r = client.get(f"/raise/{kind}")
    assert r.status_code == status
    assert set(r.json()) == {"error"}
    assert r.json()["error"]["code"] == code
    assert set(r.json()["error"]) == {"code", "message", "detail"}
    if kind == "frozen":
        assert r.json()["error"]["detail"] == {"fields": ["model.path"]}
    if kind == "bug":
        assert "secret" not in r.text


def test_invalid_body_lists_field_paths() -> None:
    r = TestClient(_app()).post("/body", json={"inner": {"x": -1}, "extra": 1})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "validation_error"
    assert [d["field"] for d in err["detail"]] == ["body.inner.x"]
    assert err["detail"][0]["type"] == "greater_than_equal"


def test_unknown_route_is_a_404_envelope() -> None:
    r = TestClient(_app()).get("/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


def test_token_required_only_when_configured() -> None:
    assert TestClient(_app()).post("/body", json={"inner": {"x": 1}}).json() == {"x": 1}
    client = TestClient(_app(token="s3cret"))
    r = client.post("/body", json={"inner": {"x": 1}})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "unauthorized"
    wrong = client.post("/body", json={"inner": {"x": 1}}, headers={"Authorization": "Bearer s3cre"})
    assert wrong.status_code == 401
    basic = client.post("/body", json={"inner": {"x": 1}}, headers={"Authorization": "Basic s3cret"})
    assert basic.status_code == 401
    ok = client.post("/body", json={"inner": {"x": 1}}, headers={"Authorization": "Bearer s3cret"})
    assert ok.json() == {"x": 1}


def test_health_and_readiness() -> None:
    assert TestClient(_app()).get("/healthz").json() == {"status": "ok"}
    assert TestClient(_app()).get("/readyz").json() == {"status": "ready", "checks": {"dep": "ok"}}
    r = TestClient(_app(ready="redis at redis://x unreachable")).get("/readyz")
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "not_ready"
    assert r.json()["error"]["detail"] == {"checks": {"dep": "redis at redis://x unreachable"}}


def test_metrics_serves_the_apps_own_registry() -> None:
    text = TestClient(_app()).get("/metrics").text
    assert "offpolicy_test_things_total 3.0" in text
    assert "process_cpu_seconds_total" in text


def test_settings_read_the_environment_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFPOLICY_API_TOKEN", "abc")
    monkeypatch.setenv("OFFPOLICY_PORT", "9001")
    assert ServiceSettings().api_token is None  # built directly: reads nothing
    settings = ServiceSettings.from_env(os.environ)
    assert settings.api_token is not None
    assert settings.api_token.get_secret_value() == "abc"
    assert settings.port == 9001
    assert "abc" not in repr(settings)


def test_json_log_lines_carry_extra_fields() -> None:
    record = logging.makeLogRecord({"name": "x", "levelname": "INFO", "msg": "step %d", "args": (3,)})
    record.version = 7
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "step 3"
    assert line["level"] == "info"
    assert line["version"] == 7
