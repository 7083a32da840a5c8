"""The learner's REST control plane on a hermetic in-process fake learner: routes, versions, 401/409/422."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.errors import FrozenFieldChange
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FakeLearner:
    """Applies handed-over configs when the test calls `boundary()`, as the real loop does between steps:
    the config gauges move and `on_config_applied(version, steps completed)` is called (the contract of
    `offpolicy.learner.trainer.Learner`)."""

    def __init__(self, config: LearnerConfig, registry: CollectorRegistry, on_config_applied) -> None:
        self.config = config
        self.metrics = LearnerMetrics(registry)
        self.metrics.record_config(0, config)
        self.on_config_applied = on_config_applied
        self.pending: tuple[LearnerConfig, int] | None = None
        self.config_version = 0
        self.step_count = 0
        self.paused = False
        self.checkpoints: list[int] = []
        self.refuse: list[str] = []  # fields the next apply_config refuses (as a frozen change)
        self.state = "running"
        self.retrying: str | None = None  # set by a test: the loop retries transient trouble

    def run(self, stop_event: threading.Event) -> None:
        stop_event.wait()

    def apply_config(self, config: LearnerConfig, config_version: int | None = None) -> None:
        assert config_version is not None
        if self.refuse:
            raise FrozenFieldChange(self.refuse)
        self.pending = (config, config_version)

    def boundary(self) -> None:
        """Switch to the pending config (as the real loop does before a step), then take the step."""
        if self.pending is not None:
            self.config, self.config_version = self.pending
            self.pending = None
            self.metrics.record_config(self.config_version, self.config)
            self.on_config_applied(self.config_version, self.step_count)
        self.step_count += 1

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def checkpoint(self) -> tuple[Path, int]:
        self.checkpoints.append(self.step_count)
        return Path(f"/ckpt/step-{self.step_count}"), self.step_count

    def status(self) -> dict[str, Any]:
        return {
            "state": "paused" if self.paused else "running",
            "policy_version": self.step_count,
            "step": self.step_count,
            "tokens_per_s": 10.0,
            "buffer": {"size": 3},
            "last_step": {"reward_mean": 0.25},
        }


@pytest.fixture
def client() -> Iterator[TestClient]:
    config = LearnerConfig(model_path="/models/tiny", redis_url="redis://127.0.0.1:1/0")
    app = create_app(LearnerServiceSettings(api_token=TOKEN), config=config, learner_factory=FakeLearner)
    with TestClient(app) as c:
        yield c


def _fake(client: TestClient) -> FakeLearner:
    return client.app.state.runtime.learner


def test_get_config_is_version_zero(client: TestClient) -> None:
    body = client.get("/v1/config").json()
    assert body["config_version"] == 0
    assert body["source"] == "initial"
    assert body["config"]["model_path"] == "/models/tiny"


def test_patch_is_pending_until_a_step_boundary(client: TestClient) -> None:
    r = client.patch("/v1/config", json={"clip_ratio_high": 0.28}, headers=AUTH)
    assert r.status_code == 202
    assert r.json()["config_version"] == 1
    assert r.json()["status"] == "pending"
    assert r.json()["changed_fields"] == ["clip_ratio_high"]
    assert client.get("/v1/config").json()["config_version"] == 0
    assert client.get("/v1/status").json()["pending_config_version"] == 1
    _fake(client).boundary()
    running = client.get("/v1/config").json()
    assert running["config_version"] == 1
    assert running["config"]["clip_ratio_high"] == 0.28
    assert running["applied_at_step"] == 0  # steps completed at the boundary: step 1 ran with it
    assert 'offpolicy_learner_config_version{run_id="default"} 1.0' in client.get("/metrics").text
    status = client.get("/v1/status").json()
    assert (status["config_version"], status["pending_config_version"]) == (1, None)


def test_patch_switches_preset_by_name_and_merges_nested(client: TestClient) -> None:
    r = client.patch("/v1/config", json={"rollout_correction": "decoupled_seq_is"}, headers=AUTH)
    assert r.json()["config"]["rollout_correction"]["rollout_is"] == "sequence"
    r = client.patch("/v1/config", json={"rollout_correction": {"rollout_is_threshold": 3.0}}, headers=AUTH)
    rc = r.json()["config"]["rollout_correction"]
    assert (rc["rollout_is"], rc["rollout_is_threshold"]) == ("sequence", 3.0)
    assert r.json()["changed_fields"] == ["rollout_correction.rollout_is_threshold"]
    assert r.json()["config_version"] == 2


def test_history_lists_every_version(client: TestClient) -> None:
    client.patch("/v1/config", json={"groups_per_step": 4}, headers=AUTH)
    _fake(client).boundary()
    client.patch("/v1/config", json={"groups_per_step": 2}, headers=AUTH)
    entries = client.get("/v1/config/history").json()["entries"]
    assert [e["config_version"] for e in entries] == [0, 1, 2]
    assert [e["source"] for e in entries] == ["initial", "patch", "patch"]
    assert [e["applied_at_step"] for e in entries] == [0, 0, None]
    assert [e["config"]["groups_per_step"] for e in entries] == [8, 4, 2]


def test_history_shows_each_changed_keys_old_and_new_value(client: TestClient) -> None:
    """`changes` pairs each changed field with the previous version's value and this one's; the `config
    history` verb prints them, one line per key (and `--json` is this answer)."""
    from offpolicy.services.cli.control import _config_history
    from offpolicy.services.client import LearnerClient

    client.patch("/v1/config", json={"groups_per_step": 4, "optimizer": {"lr": 2e-6}}, headers=AUTH)
    client.patch("/v1/config", json={"rollout_correction": "decoupled_seq_is"}, headers=AUTH)
    entries = client.get("/v1/config/history").json()["entries"]
    assert entries[0]["changes"] == []
    assert entries[1]["changes"] == [
        {"field": "groups_per_step", "old": 8, "new": 4},
        {"field": "optimizer.lr", "old": 1e-6, "new": 2e-6},
    ]
    assert {"field": "rollout_correction.rollout_is", "old": None, "new": "sequence"} in entries[2]["changes"]
    out, lines = _config_history(LearnerClient(http=client), None)  # type: ignore[arg-type]
    assert out["entries"] == entries
    assert lines[0].split()[-1] == "changed" and lines[1].split()[-1] == "-"
    assert lines[2].endswith("groups_per_step: 8 -> 4")
    assert lines[3].split() == ["optimizer.lr:", "1e-06", "->", "2e-06"]  # its own line, no version
    assert any(line.endswith('rollout_correction.rollout_is: null -> "sequence"') for line in lines)


def test_history_records_the_exact_boundary_step(client: TestClient) -> None:
    for _ in range(3):
        _fake(client).boundary()
    client.patch("/v1/config", json={"groups_per_step": 4}, headers=AUTH)
    client.patch("/v1/config", json={"groups_per_step": 2}, headers=AUTH)  # both land at one boundary
    _fake(client).boundary()
    entries = client.get("/v1/config/history").json()["entries"]
    assert [(e["config_version"], e["applied_at_step"]) for e in entries] == [(0, 0), (1, 3), (2, 3)]
    assert client.get("/v1/config").json()["config"]["groups_per_step"] == 2


def test_max_staleness_gauge_follows_the_running_config(client: TestClient) -> None:
    assert (
        'offpolicy_learner_max_staleness_steps{run_id="default"} +Inf' in client.get("/metrics").text
    )  # default: unbounded
    client.patch("/v1/config", json={"buffer": {"max_staleness": 3}}, headers=AUTH)
    assert (
        'offpolicy_learner_max_staleness_steps{run_id="default"} +Inf' in client.get("/metrics").text
    )  # still pending
    _fake(client).boundary()
    assert 'offpolicy_learner_max_staleness_steps{run_id="default"} 3.0' in client.get("/metrics").text


def test_a_change_the_learner_refuses_leaves_no_history_entry(client: TestClient) -> None:
    _fake(client).refuse = ["seed"]
    r = client.patch("/v1/config", json={"ppo_epochs": 2}, headers=AUTH)
    assert r.status_code == 409
    assert r.json()["error"]["detail"] == {"fields": ["seed"]}
    assert len(client.get("/v1/config/history").json()["entries"]) == 1


def test_invalid_patch_is_422_with_paths_and_changes_nothing(client: TestClient) -> None:
    r = client.patch(
        "/v1/config",
        json={"optimizer": {"lr": -1}, "rollout_correction": {"rollout_is": "bogus"}, "nope": 1},
        headers=AUTH,
    )
    assert r.status_code == 422
    fields = sorted(d["field"] for d in r.json()["error"]["detail"])
    assert fields == ["body.nope", "body.optimizer.lr", "body.rollout_correction.rollout_is"]
    assert len(client.get("/v1/config/history").json()["entries"]) == 1
    assert _fake(client).pending is None


def test_kl_and_entropy_fields_are_422_on_their_paths_and_switching_the_kl_loss_is_409(
    client: TestClient,
) -> None:
    r = client.patch(
        "/v1/config",
        json={"kl_loss_type": "full", "entropy_coeff": -0.1, "reference": {"cpu_offlaod": True}},
        headers=AUTH,
    )
    assert r.status_code == 422
    fields = sorted(d["field"] for d in r.json()["error"]["detail"])
    assert fields == ["body.entropy_coeff", "body.kl_loss_type", "body.reference.cpu_offlaod"]
    assert "NotImplementedError" in r.text  # verl 0.9.1's kl_penalty has no `full`
    r = client.patch("/v1/config", json={"kl_loss_coef": 0.1}, headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["detail"] == {"fields": ["kl_loss_coef"]}
    assert client.patch("/v1/config", json={"entropy_coeff": 0.01}, headers=AUTH).status_code == 202


def test_unknown_preset_name_is_422_on_the_field(client: TestClient) -> None:
    r = client.patch("/v1/config", json={"rollout_correction": "nonexistent"}, headers=AUTH)
    assert r.status_code == 422
    assert r.json()["error"]["detail"][0]["field"] == "body.rollout_correction"


def test_cross_field_error_is_422(client: TestClient) -> None:
    r = client.patch("/v1/config", json={"groups_per_step": 6, "mini_batch_groups": 4}, headers=AUTH)
    assert r.status_code == 422
    assert "mini_batch_groups=4 must divide groups_per_step=6" in r.text


def test_frozen_field_is_409_naming_it(client: TestClient) -> None:
    r = client.patch(
        "/v1/config", json={"model_path": "/other", "publish": {"weights_dir": "/w"}}, headers=AUTH
    )
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "field_frozen"
    assert r.json()["error"]["detail"] == {"fields": ["model_path", "publish.weights_dir"]}
    assert "model_path" in r.json()["error"]["message"]
    assert len(client.get("/v1/config/history").json()["entries"]) == 1


def test_put_replaces_and_needs_the_frozen_fields_unchanged(client: TestClient) -> None:
    current = client.get("/v1/config").json()["config"]
    r = client.put("/v1/config", json={**current, "ppo_epochs": 2}, headers=AUTH)
    assert r.status_code == 202
    assert r.json()["changed_fields"] == ["ppo_epochs"]
    r = client.put("/v1/config", json={"model_path": "/models/tiny"}, headers=AUTH)
    assert r.status_code == 409  # redis_url falls back to its default: a frozen field changes
    assert r.json()["error"]["detail"] == {"fields": ["redis_url"]}


def test_mutating_routes_need_the_token(client: TestClient) -> None:
    for method, path in [
        ("PATCH", "/v1/config"),
        ("PUT", "/v1/config"),
        ("POST", "/v1/pause"),
        ("POST", "/v1/resume"),
        ("POST", "/v1/checkpoints"),
    ]:
        r = client.request(method, path, json={})
        assert r.status_code == 401, (method, path)
        assert r.json()["error"]["code"] == "unauthorized"
    bad = client.patch("/v1/config", json={"ppo_epochs": 2}, headers={"Authorization": "Bearer x"})
    assert bad.status_code == 401
    assert len(client.get("/v1/config/history").json()["entries"]) == 1


def test_validate_is_a_dry_run_with_the_same_answers(client: TestClient) -> None:
    r = client.post("/v1/config/validate?mode=merge", json={"ppo_epochs": 3})
    assert r.status_code == 200
    assert r.json()["changed_fields"] == ["ppo_epochs"]
    assert client.post("/v1/config/validate?mode=merge", json={"ppo_epochs": 0}).status_code == 422
    assert client.post("/v1/config/validate?mode=merge", json={"seed": 5}).status_code == 409
    replace = client.post("/v1/config/validate", json={"ppo_epochs": 3})
    assert replace.status_code == 422  # replace: model_path has no default
    assert replace.json()["error"]["detail"][0]["field"] == "body.model_path"
    assert len(client.get("/v1/config/history").json()["entries"]) == 1


def test_presets(client: TestClient) -> None:
    presets = client.get("/v1/presets").json()["presets"]
    assert len(presets) == 19
    by_name = {p["name"]: p for p in presets}
    assert by_name["decoupled_token_is"]["aliases"] == ["token_is", "token_tis"]
    assert by_name["decoupled_token_is"]["fields"]["rollout_is"] == "token"
    alias = client.get("/v1/presets/geo_rs").json()
    assert alias["name"] == "decoupled_geo_rs"
    assert alias["fields"]["rollout_token_veto_threshold"] == 1e-4
    missing = client.get("/v1/presets/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


def test_status_pause_resume_checkpoint(client: TestClient) -> None:
    status = client.get("/v1/status").json()
    assert status["state"] == "running"
    assert status["last_step"] == {"reward_mean": 0.25}
    assert client.post("/v1/pause", headers=AUTH).json()["state"] == "paused"
    assert client.post("/v1/resume", headers=AUTH).json()["state"] == "running"
    _fake(client).boundary()
    r = client.post("/v1/checkpoints", headers=AUTH)
    assert r.status_code == 201
    assert r.json() == {"path": "/ckpt/step-1", "policy_version": 1}


def test_openapi_documents_error_models(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    patch = spec["paths"]["/v1/config"]["patch"]
    for status in ("401", "409", "422"):
        ref = patch["responses"][status]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ErrorResponse"
    put_schema = spec["paths"]["/v1/config"]["put"]["requestBody"]["content"]["application/json"]
    assert put_schema["schema"]["$ref"] == "#/components/schemas/LearnerConfig"
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
