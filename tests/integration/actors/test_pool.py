"""Several runs on one actor pool (real vLLM on CPU with LoRA, real Redis, the actor service's app): one
engine on the tiny base model serves run A (its learner's adapter), run F (whose reward raises on every
group) and run B, added through `POST /v1/runs` while the others generate, with its own adapter. Each run's
buffer holds only its own groups, and every token's behaviour log-prob is the learner's under its own run's
adapter (not the other run's); F's failures (its reward, a full-weight record from its learner) cost A
nothing; `DELETE /v1/runs/B` stops B's groups while A goes on and answers what B served; B added back
(like B added the first time) issues no request before its learner's adapter is loaded."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import EngineConfig, LoraEngineConfig
from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.actors.engine.vllm import VLLMEngine
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import load_model, lora
from offpolicy.learner.model.policy import token_logprobs
from offpolicy.learner.persist.durable_writes import Persistence
from offpolicy.services.actor_api.main import create_app
from offpolicy.services.common.settings import ActorServiceSettings
from offpolicy.weights.record import PolicyRecord, PolicyStore
from tests.integration.actors.actor_run import actor_config, drain, wait_until
from tests.integration.actors.test_lora import LORA, _perturb_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

AUTH = {"Authorization": "Bearer tok"}
ENGINE = EngineConfig.cpu_tiny(
    max_model_len=256, lora=LoraEngineConfig(max_rank=8, max_loras=3, max_cpu_loras=6)
)


def always_raises(completion: str, answer: str | None, metadata: dict[str, str]) -> float:
    """Run F's reward: every group fails (a broken verifier)."""
    raise ValueError("the verifier is down")


def publish_adapter(
    model_dir: Path, weights: Path, redis_url: str, run_id: str, seed: int
) -> torch.nn.Module:
    """Run `run_id`'s learner publishing its v1 adapter (perturbed B factors, seeded) the trainer's way; the
    policy it holds (the learner's view of v1)."""
    model = lora.inject(load_model(model_dir, "cpu"), LORA, seed=0).eval()
    _perturb_adapter(model, seed)
    config = LearnerConfig.model_validate(
        {"model_path": str(model_dir), "lora": LORA.model_dump(), "publish": {"weights_dir": str(weights)}}
    )
    store = PolicyStore(redis_url, run_id)
    persist = Persistence(config, model, None, torch.float32, store, LearnerMetrics(CollectorRegistry()))
    try:
        persist.publish(1)
        persist.flush()
        assert (record := store.read()) is not None and (record.version, record.kind) == (1, "lora")
    finally:
        persist.close()
        store.close()
    return copy.deepcopy(model)


def inserted(redis_url: str, run_id: str) -> int:
    with ReplayBuffer(redis_url, run_id) as buf:
        return buf.stats().inserted_total


def run_body(model_dir: Path, toy: Path, redis_url: str, run_id: str, **over: Any) -> dict[str, Any]:
    """A run's config as a REST body: `model_path` and `engine` left out (the pool's)."""
    cfg = actor_config(model_dir, toy, redis_url, run_id, engine=ENGINE, **over)
    return cfg.model_dump(mode="json", exclude={"model_path", "engine", "runs"})


def check_logprobs(
    groups: list, policies: dict[int, torch.nn.Module], other: torch.nn.Module
) -> tuple[int, float]:
    """Every token's behaviour log-prob against the learner's under its version's policy (<= 1e-4); the
    adapter's (version 1) tokens checked, and their largest gap under `other` (another run's adapter)."""
    checked, teeth = 0, 0.0
    for g in groups:
        batch = collate([g], pad_token_id=0)
        with torch.no_grad():
            lps = {v: token_logprobs(m, batch) for v, m in policies.items()}  # (n, R) per version
            foreign = token_logprobs(other, batch)  # (n, R)
        for i, t in enumerate(g.trajectories):
            versions = (
                t.versions if t.versions is not None else np.full(len(t.response_ids), g.policy_version)
            )
            for j, v in enumerate(versions.tolist()):
                behaviour = float(t.behavior_logprobs[j])
                assert abs(float(lps[v][i, j]) - behaviour) <= 1e-4, (g.actor_id, v, i, j)
                if v == 1:
                    teeth = max(teeth, abs(float(foreign[i, j]) - behaviour))
                checked += v == 1
    return checked, teeth


def test_one_pool_serves_runs_with_their_own_adapters_buffers_and_failures(
    model_dir: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    runs = {name: f"{run_id}-{name}" for name in "afb"}
    dataset = write_target_token_dataset(tmp_path / "toy.jsonl", 12)
    endless = {"path": str(dataset), "chat_template": False}
    base = load_model(model_dir, "cpu").eval()
    policy_a = publish_adapter(model_dir, tmp_path / "wa", redis_url, runs["a"], seed=1)
    policy_b = publish_adapter(model_dir, tmp_path / "wb", redis_url, runs["b"], seed=2)
    failing = {"name": f"{__name__}.always_raises"}
    run_f = run_body(
        model_dir, dataset, redis_url, runs["f"], dataset=endless, actor_id="actor-f", max_inflight_prompts=2,
        reward=failing,
    )  # fmt: skip
    config = actor_config(
        model_dir, dataset, redis_url, runs["a"], engine=ENGINE, dataset=endless, actor_id="actor-a",
        max_inflight_prompts=4, runs=[run_f],
    )  # fmt: skip
    engine = VLLMEngine(ENGINE, str(model_dir))  # built here, in the main thread; shared with the app
    app = create_app(ActorServiceSettings(api_token="tok"), config=config, engine=engine)
    collected: dict[str, list] = {"a": [], "b": []}

    def has_v1(name: str):
        def check() -> bool:
            collected[name].extend(drain(redis_url, runs[name], 1))
            return any(g.policy_version == 1 for g in collected[name])

        return check

    try:
        with TestClient(app) as http:
            wait_until(lambda: http.get("/readyz").status_code == 200, 120, "the actor service")
            wait_until(has_v1("a"), 120, "run A's groups on its adapter v1")

            def f_failures() -> int:
                f = next(r for r in http.get("/v1/runs").json()["runs"] if r["run_id"] == runs["f"])
                assert f["state"] == "running", f
                return f["reward_failures"].get("raised", 0)

            wait_until(lambda: f_failures() >= 3, 60, "run F's rewards to fail")
            store = PolicyStore(
                redis_url, runs["f"]
            )  # F's learner publishes full weights: refused, F's alone
            store.publish(PolicyRecord(1, "file:///nowhere/v1", "0" * 64, time.time(), "full"))
            store.close()

            def refused() -> dict[str, str | None]:
                return {r["run_id"]: r["refused_record"] for r in http.get("/v1/runs").json()["runs"]}

            wait_until(lambda: refused()[runs["f"]] is not None, 30, "run F to refuse the full-weight record")
            assert "full weights" in refused()[runs["f"]] and refused()[runs["a"]] is None
            body = run_body(
                model_dir,
                dataset,
                redis_url,
                runs["b"],
                dataset=endless,
                actor_id="actor-b",
                max_inflight_prompts=4,
            )
            r = http.post("/v1/runs", json=body, headers=AUTH)
            assert r.status_code == 201, r.text
            wait_until(has_v1("b"), 120, "run B (added while the others run) on its adapter v1")
            states = {r["run_id"]: r["state"] for r in http.get("/v1/runs").json()["runs"]}
            assert states == {runs["a"]: "running", runs["f"]: "running", runs["b"]: "running"}
            loaded = {r["run_id"]: r["adapters_loaded"] for r in http.get("/v1/runs").json()["runs"]}
            assert loaded[runs["a"]] == [1] and loaded[runs["b"]] == [1] and loaded[runs["f"]] == []

            r = http.delete(f"/v1/runs/{runs['b']}", headers=AUTH)
            assert r.status_code == 200 and r.json()["state"] == "removed"
            last = r.json()  # what B served, not what is left once its adapters are gone
            assert (last["adapter_version"], last["loaded_policy_version"]) == (1, 1), last
            assert runs["b"] not in engine.adapter_table.runs and engine.adapter_table.held == 1
            b_after, a_after = inserted(redis_url, runs["b"]), inserted(redis_url, runs["a"])
            collected["a"].extend(drain(redis_url, runs["a"], 1))
            wait_until(lambda: inserted(redis_url, runs["a"]) >= a_after + 4, 60, "run A going on")
            assert inserted(redis_url, runs["b"]) == b_after, "a removed run pushes nothing more"
            assert f_failures() > 3 and inserted(redis_url, runs["f"]) == 0
            r = http.post("/v1/runs", json=body, headers=AUTH)  # B added back: it starts from its record
            assert r.status_code == 201, r.text
            wait_until(lambda: inserted(redis_url, runs["b"]) >= b_after + 4, 120, "run B added back")
        collected["a"].extend(drain(redis_url, runs["a"], 1))
        collected["b"].extend(drain(redis_url, runs["b"], 1))
    finally:
        engine.shutdown()
    assert {g.actor_id for g in collected["a"]} == {"actor-a"}, "each run's buffer holds its own groups"
    assert {g.actor_id for g in collected["b"]} == {"actor-b"}
    # B was added (twice) after its learner published v1: no request of it ran before v1 was loaded
    b_versions = {
        v
        for g in collected["b"]
        for t in g.trajectories
        for v in (t.versions.tolist() if t.versions is not None else [g.policy_version])
    }
    assert b_versions == {1} and len(collected["b"]) >= 8, (b_versions, len(collected["b"]))
    checked_a, teeth_a = check_logprobs(collected["a"][:40], {0: base, 1: policy_a}, policy_b)
    checked_b, teeth_b = check_logprobs(collected["b"][:40], {0: base, 1: policy_b}, policy_a)
    assert checked_a > 30 and checked_b > 30, (checked_a, checked_b)
    assert teeth_a > 1e-3 and teeth_b > 1e-3, "under the other run's adapter the log-probs differ"
