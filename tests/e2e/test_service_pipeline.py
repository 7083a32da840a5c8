"""End to end: embedded Redis + learner service + one actor service (real vLLM on CPU) as child processes.

One module-scoped stack is shared by every test here (vLLM starts once): the policy version advances, the
actor reloads it, sampled staleness stays within `max_staleness`, the reward of the target-token task
rises, the inline evaluation of held-out prompts reports it rising too, every declared metric is exported,
and config changes over HTTP behave (applied at a step
boundary, in the history and the metrics; 422 and 401 change nothing).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from offpolicy.actors.metrics import ActorMetrics
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.metrics import BufferMetrics
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.children import ServiceProcess, start_service
from offpolicy.services.quickstart.configs import TOY_BUFFER, actor_config, learner_config

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]
TOKEN = "e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_STALENESS = TOY_BUFFER["max_staleness"]


@dataclass
class Stack:
    learner: ServiceProcess
    actor: ServiceProcess
    steps_file: Path

    def get(self, path: str, service: str = "learner") -> httpx.Response:
        return httpx.get(getattr(self, service).url + path, timeout=10)

    def patch(self, body: dict, headers: dict | None = None) -> httpx.Response:
        return httpx.patch(f"{self.learner.url}/v1/config", json=body, headers=headers, timeout=10)

    def steps(self) -> list[dict]:
        lines = self.steps_file.read_text().splitlines() if self.steps_file.exists() else []
        return [json.loads(line) for line in lines]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from offpolicy.actors.data.toy import write_target_token_dataset

    root = tmp_path_factory.mktemp("e2e")
    model = str(make_tiny_model(root / "model"))
    dataset = write_target_token_dataset(root / "dataset.jsonl")
    held_out = write_target_token_dataset(root / "held_out.jsonl", num_prompts=16, seed=1)
    with EmbeddedRedis.start(root / "redis") as redis:
        learner_yaml, actor_yaml = root / "learner.yaml", root / "actor.yaml"
        learner_yaml.write_text(yaml.safe_dump(learner_config(root, model, redis.url, "e2e")))
        actor_yaml.write_text(
            yaml.safe_dump(actor_config(model, dataset, redis.url, "e2e", eval_dataset=held_out))
        )
        env = {"OFFPOLICY_API_TOKEN": TOKEN}
        learner = start_service("learner", learner_yaml, root / "learner.log", env=env)
        actor = start_service("actor", actor_yaml, root / "actor.log", env=env)
        try:
            learner.wait_ready(timeout_s=180)
            actor.wait_ready(timeout_s=300)
            yield Stack(learner, actor, root / "learner_steps.jsonl")
        finally:
            codes = actor.stop(), learner.stop()
            assert all(code in (0, -signal.SIGTERM) for code in codes), (codes, actor.log_tail())


def test_pipeline_learns_with_bounded_staleness(stack: Stack) -> None:
    wait_for(lambda: len(stack.steps()) >= 12, timeout_s=300, what="12 learner steps")
    steps = stack.steps()
    status = stack.get("/v1/status").json()
    assert status["policy_version"] >= 12
    actor = stack.get("/v1/status", "actor").json()
    assert actor["reloads"] >= 1
    assert actor["loaded_policy_version"] >= 1
    assert actor["groups_pushed"] >= 12 * 4
    # staleness: every sampled group within the bound (the learner's histogram has nothing above it)
    families = {f.name: f for f in text_string_to_metric_families(stack.get("/metrics").text)}
    hist = {
        s.labels.get("le"): s.value
        for s in families["offpolicy_learner_sampled_staleness_steps"].samples
        if s.name.endswith("_bucket")
    }
    assert hist[f"{float(MAX_STALENESS)}"] == hist["+Inf"] > 0
    assert max(s["staleness_mean"] for s in steps) <= MAX_STALENESS
    # the reward of the target-token task rises
    rewards = [s["reward_mean"] for s in steps]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, rewards


def test_the_held_out_evaluation_rises_with_training(stack: Stack) -> None:
    """The actor evaluates 16 held-out prompts x 4 every 3 versions (its weight loads waiting); the learner
    carries each evaluation on its next step's line: the held-out reward rises with the versions."""
    wait_for(
        lambda: len({s["eval/policy_version"] for s in stack.steps() if "eval/policy_version" in s}) >= 3,
        timeout_s=300,
        what="three evaluated versions",
    )
    evals = {int(s["eval/policy_version"]): s for s in stack.steps() if "eval/policy_version" in s}
    versions = sorted(evals)
    assert versions[0] == 0 and all(v % 3 == 0 for v in versions), versions
    assert all(evals[v]["eval/prompts"] == 16 for v in versions)
    first, last = evals[versions[0]]["eval/reward_mean"], evals[versions[-1]]["eval/reward_mean"]
    assert last > first + 0.05, {v: evals[v]["eval/reward_mean"] for v in versions}
    actor = stack.get("/v1/status", "actor").json()
    assert actor["last_eval"]["eval/policy_version"] >= versions[-1]


def _declared(metrics_cls: type) -> set[str]:
    registry = CollectorRegistry()
    metrics_cls(registry)
    return {family.name for family in registry.collect()}


def test_every_declared_metric_is_exported(stack: Stack) -> None:
    exported: set[str] = set()
    for service in ("learner", "actor"):
        exported |= {f.name for f in text_string_to_metric_families(stack.get("/metrics", service).text)}
    for cls in (LearnerMetrics, ActorMetrics, BufferMetrics):
        missing = _declared(cls) - exported
        assert not missing, (cls.__name__, sorted(missing))
    assert "offpolicy_learner_config_version" in exported


def test_config_patch_mid_run(stack: Stack) -> None:
    before = stack.get("/v1/config").json()
    # an invalid PATCH is a 422 and changes nothing; a PATCH without the token is a 401
    bad = stack.patch({"rollout_correction": {"rollout_is_threshold": -1.0}}, AUTH)
    assert bad.status_code == 422
    assert bad.json()["error"]["detail"][0]["field"].startswith("body.rollout_correction")
    assert stack.patch({"clip_ratio_high": 0.3}).status_code == 401
    assert stack.get("/v1/config/history").json()["entries"][-1]["config_version"] == before["config_version"]
    # switch the preset, then change a threshold: both land at the next step boundary
    step = stack.get("/v1/status").json()["step"]
    switched = stack.patch({"rollout_correction": "decoupled_seq_is"}, AUTH)
    assert switched.status_code == 202
    threshold = stack.patch({"rollout_correction": {"rollout_is_threshold": 3.0}}, AUTH)
    assert threshold.json()["changed_fields"] == ["rollout_correction.rollout_is_threshold"]
    version = threshold.json()["config_version"]
    wait_for(lambda: stack.get("/v1/config").json()["config_version"] == version, 120, "the switch")
    running = stack.get("/v1/config").json()
    assert running["config"]["rollout_correction"]["rollout_is"] == "sequence"
    assert running["config"]["rollout_correction"]["rollout_is_threshold"] == 3.0
    assert running["applied_at_step"] >= step
    entries = stack.get("/v1/config/history").json()["entries"]
    assert [e["config_version"] for e in entries][-2:] == [version - 1, version]
    assert all(e["applied_at"] is not None for e in entries)
    metrics = stack.get("/metrics").text
    run_id = running["config"]["run_id"]  # every exported sample carries the run's id
    assert f'offpolicy_learner_config_version{{run_id="{run_id}"}} {float(version)}' in metrics
    # the next steps run with it: sequence-level IS metrics appear in the step records
    wait_for(lambda: stack.get("/v1/status").json()["step"] > running["applied_at_step"] + 1, 120, "a step")
    assert "rollout_corr/rollout_is_seq_mean" in stack.get("/v1/status").json()["last_step"]
