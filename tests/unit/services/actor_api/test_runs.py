"""The actor service's `/v1/runs` routes on a pool of fake actors and a stub engine (hermetic): the bearer
token, each refusal's envelope (401, 404, 409 with the reason, 422 with the field path), a run added,
changed and removed while the others run, every run's metrics under its own `run_id`, and a service that is
dead only once every run's loop died."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from offpolicy.actors.config import ActorConfig
from offpolicy.services.actor_api.main import create_app
from offpolicy.services.common.settings import ActorServiceSettings
from tests.unit.actors.rollout.fakes import StubEngine
from tests.unit.actors.rollout.test_pool import LORA, IdleActor

AUTH = {"Authorization": "Bearer tok"}


class MeteredActor(IdleActor):
    """Declares the real actor metrics on its run's registry; pushed groups = its index in the pool."""

    def __init__(self, config: ActorConfig, registry: CollectorRegistry, engine: Any) -> None:
        super().__init__(config, registry, engine)
        self.metrics.groups_pushed.inc(len(config.run_id))

    def status(self) -> dict[str, Any]:
        versions = {"loaded_policy_version": 0, "learner_policy_version": None}
        pushed = len(self.config.run_id)
        return {"state": "running", "actor_id": "a0", **versions, "tokens_per_s": None,
                "groups_pushed": pushed, "reloads": 0}  # fmt: skip


def app_for(run_id: str = "a", **over: Any) -> tuple[Any, StubEngine]:
    config = ActorConfig.model_validate(
        {"model_path": "/base", "engine": LORA, "run_id": run_id, "dataset": {"path": "/a.jsonl"}} | over
    )
    engine = StubEngine(kind="lora")
    settings = ActorServiceSettings(api_token="tok", fatal_exit_grace_s=30)
    return create_app(settings, config=config, actor_factory=MeteredActor, engine=engine), engine


def run_body(run_id: str, **over: Any) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "dataset": {"path": f"/{run_id}.jsonl"},
        "redis_url": "redis://:pw-b@r:6379/0",
    } | over


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_runs_are_added_changed_and_removed_with_the_token_and_every_refusal_says_why() -> None:
    app, engine = app_for()
    with TestClient(app) as http:
        assert [r["run_id"] for r in http.get("/v1/runs").json()["runs"]] == ["a"]
        assert http.post("/v1/runs", json=run_body("b")).status_code == 401
        bad = http.post("/v1/runs", json=run_body("b", sampling={"temperature": -1}), headers=AUTH)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"
        assert [d["field"] for d in bad.json()["error"]["detail"]] == ["body.sampling.temperature"]
        nested = http.post("/v1/runs", json=run_body("b", runs=[run_body("c")]), headers=AUTH)
        assert nested.status_code == 422 and nested.json()["error"]["detail"][0]["field"] == "body.runs"
        for body, reason in (
            (run_body("a"), "already served"),
            (run_body("b", model_path="/other"), "not this pool's base model"),
            (run_body("b", engine={}), "full-weight and adapter runs cannot share a pool"),
        ):
            r = http.post("/v1/runs", json=body, headers=AUTH)
            assert (r.status_code, r.json()["error"]["code"]) == (409, "run_conflict"), r.text
            assert reason in r.json()["error"]["message"]
        r = http.post("/v1/runs", json=run_body("b", max_inflight_prompts=3), headers=AUTH)
        assert r.status_code == 201 and r.json()["run_id"] == "b" and r.json()["max_inflight_prompts"] == 3
        assert "pw-b" not in r.text and engine.added == ["a", "b"]
        b = app.state.runtime.pool.run("b")
        assert (b.config.model_path, b.config.engine) == ("/base", app.state.runtime.config.engine)
        status = http.get("/v1/status").json()
        assert status["runs"] == {"a": "running", "b": "running"} and status["groups_pushed"] == 1  # a's

        patch = {"max_inflight_prompts": 5, "sampling": {"temperature": 0.5}}
        assert http.patch("/v1/runs/b", json=patch).status_code == 401
        r = http.patch("/v1/runs/b", json=patch, headers=AUTH)
        assert r.status_code == 200 and r.json()["max_inflight_prompts"] == 5
        assert b.actor.reconfigured[-1].sampling.temperature == 0.5
        r = http.patch("/v1/runs/b", json={"reward": {"name": "math_answer"}}, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (409, "field_frozen")
        assert r.json()["error"]["detail"] == {"fields": ["reward.name"]}
        r = http.patch("/v1/runs/b", json={"sampling": {"temperature": 0}}, headers=AUTH)
        assert r.status_code == 422 and r.json()["error"]["detail"][0]["field"] == "body.sampling.temperature"
        r = http.patch("/v1/runs/zz", json=patch, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "run_not_found")

        assert http.delete("/v1/runs/b").status_code == 401
        assert http.delete("/v1/runs/zz", headers=AUTH).status_code == 404
        r = http.delete("/v1/runs/b", headers=AUTH)
        assert r.status_code == 200 and r.json()["state"] == "removed" and engine.dropped == ["b"]
        assert [r["run_id"] for r in http.get("/v1/runs").json()["runs"]] == ["a"]


def test_metrics_carry_each_runs_id_one_family_per_name() -> None:
    app, _ = app_for()
    with TestClient(app) as http:
        http.post("/v1/runs", json=run_body("run-bb"), headers=AUTH)
        text = http.get("/metrics").text
    families = [f for f in text_string_to_metric_families(text) if f.name == "offpolicy_actor_groups_pushed"]
    assert len(families) == 1 and text.count("# TYPE offpolicy_actor_groups_pushed_total counter") == 1
    pushed = {s.labels["run_id"]: s.value for s in families[0].samples if s.name.endswith("_total")}
    assert pushed == {"a": 1.0, "run-bb": 6.0}
    process = [f for f in text_string_to_metric_families(text) if f.name == "process_cpu_seconds"]
    assert [s.labels for f in process for s in f.samples] == [{"run_id": "a"}]  # the process's: once


def test_one_runs_death_is_its_own_and_the_service_dies_with_the_last() -> None:
    app, _ = app_for()
    with TestClient(app) as http:
        http.post("/v1/runs", json=run_body("doomed-b"), headers=AUTH)
        wait_for(lambda: http.get("/v1/status").json()["runs"].get("doomed-b") == "failed")
        runs = {r["run_id"]: r for r in http.get("/v1/runs").json()["runs"]}
        assert runs["doomed-b"]["error"] == "RuntimeError: the reward module is gone"
        assert runs["a"]["state"] == "running"
        status = http.get("/v1/status").json()  # the first run's status, and every failed run's reason
        assert status["failed_runs"] == {"doomed-b": "RuntimeError: the reward module is gone"}
        assert status["state"] == "running" and status["error"] is None  # a's
        assert http.get("/healthz").status_code == 200 and app.state.runtime.readiness() is None
        assert http.delete("/v1/runs/doomed-b", headers=AUTH).status_code == 200
        assert http.get("/v1/status").json()["failed_runs"] == {}

    app, _ = app_for("doomed-a", runs=[run_body("doomed-b")])
    with TestClient(app) as http:
        wait_for(lambda: app.state.runtime.liveness() is not None)
        r = http.get("/healthz")
        assert r.status_code == 503 and r.json()["error"]["detail"]["reason"].startswith(
            "every run's loop failed: doomed-a: RuntimeError: the reward module is gone; doomed-b: "
        )
        assert r.json()["error"]["detail"]["exit_in_s"] is not None


def test_the_openapi_document_has_the_runs_routes_with_their_errors() -> None:
    app, _ = app_for()
    with TestClient(app) as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert set(paths["/v1/runs"]) == {"get", "post"} and set(paths["/v1/runs/{run_id}"]) == {
        "patch",
        "delete",
    }
    post = paths["/v1/runs"]["post"]["responses"]
    assert {"201", "401", "409", "422"} <= set(post)
    assert (
        post["409"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorResponse"
    )
    assert {"401", "404", "409", "422"} <= set(paths["/v1/runs/{run_id}"]["patch"]["responses"])


def test_a_run_id_that_is_not_a_key_or_a_folder_name_is_a_422_and_changes_nothing() -> None:
    """One run-id type for every boundary (offpolicy/config/base.py `RunId`): `../x`, `..`, a brace (the
    Redis hash tag) are refused by POST with the field's path, by the run routes' path, and by the learner's
    and the actor's configs; the pool is unchanged."""
    import pytest
    from pydantic import ValidationError

    from offpolicy.buffer.keys import BufferKeys
    from offpolicy.learner.config import LearnerConfig

    app, engine = app_for()
    with TestClient(app) as http:
        for bad in ("../x", "..", "a{b}", "a/b", "x" * 129):
            r = http.post("/v1/runs", json=run_body(bad), headers=AUTH)
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["error"]["detail"][0]["field"] == "body.run_id", (bad, r.text)
        assert http.delete("/v1/runs/..%2Fx", headers=AUTH).status_code in (404, 422)
        assert http.patch("/v1/runs/a%7Bb%7D", json={}, headers=AUTH).status_code == 422
        assert [r["run_id"] for r in http.get("/v1/runs").json()["runs"]] == ["a"] and engine.added == ["a"]
    for bad in ("../x", ".", ".."):
        with pytest.raises(ValidationError, match="run_id"):
            LearnerConfig(model_path="/m", redis_url="redis://h:1/0", run_id=bad)
        with pytest.raises(ValidationError, match="run_id"):
            ActorConfig.model_validate({"model_path": "/m", "run_id": bad, "dataset": {"path": "/a.jsonl"}})
        with pytest.raises(ValueError, match="run_id"):
            BufferKeys.for_run(bad)
    ok = LearnerConfig(model_path="/m", redis_url="redis://h:1/0", run_id="grpo-7b.v2:seed_1")
    assert ok.weights_path.parts[-2] == "grpo-7b.v2:seed_1"


def test_a_run_cannot_claim_the_shared_engine_past_the_bounds() -> None:
    """`max_inflight_prompts` 10^9 or 2^64, by POST or PATCH: a 422 naming the field and its limit; the run
    keeps its share."""
    app, _ = app_for()
    with TestClient(app) as http:
        for huge in (10**9, 2**64):
            r = http.post("/v1/runs", json=run_body("b", max_inflight_prompts=huge), headers=AUTH)
            assert (
                r.status_code == 422
                and r.json()["error"]["detail"][0]["field"] == "body.max_inflight_prompts"
            )
            assert "4096" in r.text
            r = http.patch("/v1/runs/a", json={"max_inflight_prompts": huge}, headers=AUTH)
            assert r.status_code == 422, r.text
            r = http.post("/v1/runs", json=run_body("b", sampling={"n": huge}), headers=AUTH)
            assert r.status_code == 422 and r.json()["error"]["detail"][0]["field"] == "body.sampling.n"
        assert [r["run_id"] for r in http.get("/v1/runs").json()["runs"]] == ["a"]
        assert http.get("/v1/runs").json()["runs"][0]["max_inflight_prompts"] == 16
