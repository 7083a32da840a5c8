"""What the services export to Prometheus: `run_id` on every sample, and the running config's metrics
(`offpolicy_learner_config_version`, `offpolicy_learner_config_info{config_version, preset}`) moving exactly
when the learner applies a change (hermetic: the learner app on `FakeLearner`, the actor app on an actor
that declares the real actor and buffer metrics)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from offpolicy.actors.config import ActorConfig
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.buffer.metrics import BufferMetrics
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.correction.config import RolloutCorrectionConfig
from offpolicy.services.actor_api.main import create_app as create_actor_app
from offpolicy.services.common.metrics import exposition, make_registry
from offpolicy.services.common.settings import ActorServiceSettings, LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.unit.actors.rollout.fakes import StubEngine
from tests.unit.services.learner_api.test_routes import AUTH, TOKEN, FakeLearner


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition: (name, labels, value)."""
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def info_series(client: TestClient) -> list[dict[str, str]]:
    return [
        labels
        for name, labels, _ in samples(client.get("/metrics").text)
        if name == "offpolicy_learner_config_info"
    ]


def learner_client(run_id: str = "default", **fields: Any) -> TestClient:
    config = LearnerConfig(
        model_path="/models/tiny", redis_url="redis://127.0.0.1:1/0", run_id=run_id, **fields
    )
    return TestClient(
        create_app(LearnerServiceSettings(api_token=TOKEN), config=config, learner_factory=FakeLearner)
    )


class MetricsOnlyActor:
    """Declares what a real actor declares on the service's registry (its own metrics and its buffer's),
    then idles."""

    def __init__(self, config: Any, registry: CollectorRegistry, engine: Any) -> None:
        self.metrics, self.buffer_metrics = ActorMetrics(registry), BufferMetrics(registry)
        self.metrics.groups_pushed.inc(2)

    def run(self, stop_event: threading.Event) -> None:
        stop_event.wait()

    def status(self) -> dict[str, Any]:
        return {"state": "running", "actor_id": "a0", "loaded_policy_version": 0, "learner_policy_version": 0,
                "tokens_per_s": None, "groups_pushed": 2, "reloads": 0}  # fmt: skip

    def close(self) -> None:
        pass


# --- run_id on every sample


def test_every_sample_the_learner_exports_carries_its_run_id() -> None:
    with learner_client(run_id="exp-7") as client:
        exported = samples(client.get("/metrics").text)
        names = {name for name, _, _ in exported}
        assert {"offpolicy_learner_config_version", "offpolicy_learner_step_seconds_bucket",
                "offpolicy_learner_groups_rejected_total", "process_cpu_seconds_total"} <= names  # fmt: skip
        assert [(n, labels) for n, labels, _ in exported if labels.get("run_id") != "exp-7"] == []
        # declared labels keep their names beside it; in-process reads see the metrics as declared
        rejected = [labels for n, labels, _ in exported if n == "offpolicy_learner_groups_rejected_total"]
        assert {"field", "run_id"} == set(rejected[0])
        registry = client.app.state.registry
        assert registry.get_sample_value("offpolicy_learner_config_version") == 0.0


def test_every_sample_an_actor_exports_carries_its_run_id() -> None:
    config = ActorConfig(model_path="/m", dataset={"path": "/d.jsonl"}, run_id="exp-8")
    app = create_actor_app(
        ActorServiceSettings(), config=config, actor_factory=MetricsOnlyActor, engine=StubEngine()
    )
    with TestClient(app) as client:
        exported = samples(client.get("/metrics").text)
    names = {name for name, _, _ in exported}
    assert {"offpolicy_actor_groups_pushed_total", "offpolicy_buffer_size_groups",
            "offpolicy_buffer_insert_latency_seconds_bucket"} <= names  # fmt: skip
    assert [(n, labels) for n, labels, _ in exported if labels.get("run_id") != "exp-8"] == []
    assert ("offpolicy_actor_groups_pushed_total", {"run_id": "exp-8"}, 2.0) in exported


def test_a_declared_run_id_label_keeps_its_value() -> None:
    registry = make_registry({"run_id": "mine"})
    Gauge("offpolicy_test_g", "g", ["run_id"], registry=registry).labels(run_id="other").set(1)
    Gauge("offpolicy_test_h", "h", registry=registry).set(2)
    exported = {(n, labels["run_id"]) for n, labels, _ in samples(exposition(registry).decode())}
    assert {("offpolicy_test_g", "other"), ("offpolicy_test_h", "mine")} <= exported


def test_a_registry_without_constant_labels_exports_as_declared() -> None:
    registry = CollectorRegistry()
    Gauge("offpolicy_test_g", "g", registry=registry).set(3)
    assert samples(exposition(registry).decode()) == [("offpolicy_test_g", {}, 3.0)]


# --- the running config's metrics


def test_config_metrics_move_when_the_learner_applies_a_change_not_before() -> None:
    with learner_client() as client:
        learner = client.app.state.runtime.learner
        assert info_series(client) == [{"config_version": "0", "preset": "disabled", "run_id": "default"}]
        r = client.patch("/v1/config", json={"rollout_correction": "decoupled_seq_is"}, headers=AUTH)
        assert r.status_code == 202
        assert info_series(client) == [{"config_version": "0", "preset": "disabled", "run_id": "default"}]
        learner.boundary()  # the step boundary where the loop switches
        assert info_series(client) == [
            {"config_version": "1", "preset": "decoupled_seq_is", "run_id": "default"}
        ]  # one series: the previous config's is gone
        text = client.get("/metrics").text
        assert 'offpolicy_learner_config_version{run_id="default"} 1.0' in text
        # a field changed away from the preset's defaults: no preset any more
        client.patch("/v1/config", json={"rollout_correction": {"rollout_is_threshold": 3.0}}, headers=AUTH)
        learner.boundary()
        assert info_series(client) == [{"config_version": "2", "preset": "custom", "run_id": "default"}]
        # a PUT of the whole config counts the same way
        body = client.get("/v1/config").json()["config"] | {"rollout_correction": "bypass_ppo_clip"}
        assert client.put("/v1/config", json=body, headers=AUTH).status_code == 202
        learner.boundary()
        assert info_series(client) == [
            {"config_version": "3", "preset": "bypass_ppo_clip", "run_id": "default"}
        ]


@pytest.mark.parametrize(
    ("config", "name"),
    [
        (RolloutCorrectionConfig.decoupled_token_is(), "decoupled_token_is"),
        (RolloutCorrectionConfig.from_preset("token_is"), "decoupled_token_is"),  # an alias: its canonical
        (RolloutCorrectionConfig.from_preset("geo_rs"), "geo_rs"),  # the veto variant has no canonical twin
        (RolloutCorrectionConfig(), "disabled"),
        (
            RolloutCorrectionConfig(
                **{**RolloutCorrectionConfig.decoupled_token_is().model_dump(), "rollout_is_threshold": 5.0}
            ),
            "custom",
        ),
    ],
)
def test_preset_name_of_a_config(config: RolloutCorrectionConfig, name: str) -> None:
    assert config.preset_name() == name
