"""The actor pool (hermetic: a stub engine, actors that idle or die): runs started from the config, added,
changed and removed while the others run, each on its own view of the engine; every refusal with its reason
(another base model, a full-weight run, a duplicate id, no room for the adapters, a field that cannot
change); a run whose loop dies is failed alone."""

from __future__ import annotations

import threading
import time
from typing import Any

import pydantic
import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ActorConfig
from offpolicy.actors.errors import RunConflict, RunFieldFrozen, RunNotFound
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.pool import Pool
from tests.unit.actors.rollout.fakes import StubEngine

LORA = {"lora": {"max_rank": 8, "max_loras": 3, "max_cpu_loras": 6}}


class IdleActor:
    """Idles until stopped; a run id starting with `doomed` dies at once. Records what the pool calls."""

    def __init__(self, config: ActorConfig, registry: CollectorRegistry, engine: Any) -> None:
        self.config, self.registry, self.engine = config, registry, engine
        self.metrics = ActorMetrics(registry)
        self.reconfigured: list[ActorConfig] = []
        self.closed = False

    def run(self, stop_event: threading.Event) -> None:
        if self.config.run_id.startswith("doomed"):
            raise RuntimeError("the reward module is gone")
        stop_event.wait()

    def status(self) -> dict[str, Any]:
        """Version 7 served until its adapters leave the engine (a LoRA view dropped) or it is closed."""
        gone = self.closed or getattr(self.engine, "dropped", False)
        return {
            "state": "running",
            "actor_id": "a0",
            "groups_pushed": 3,
            "loaded_policy_version": None if gone else 7,
        }

    def reconfigure(self, config: ActorConfig) -> None:
        self.reconfigured.append(config)

    def close(self) -> None:
        self.closed = True


def run_config(run_id: str, **over: Any) -> ActorConfig:
    base = {"model_path": "/base", "engine": LORA, "run_id": run_id, "dataset": {"path": f"/{run_id}.jsonl"}}
    return ActorConfig.model_validate(base | over)


def started(config: ActorConfig, engine: StubEngine | None = None, **kw: Any) -> tuple[Pool, StubEngine]:
    engine = engine or StubEngine(kind="lora" if config.engine.lora is not None else "full")
    pool = Pool(config, lambda run_id: CollectorRegistry(), engine=engine, actor_factory=IdleActor, **kw)
    pool.start()
    return pool, engine


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_configs_runs_start_each_on_its_view_of_the_engine_and_runs_come_and_go():
    config = run_config("a", runs=[{"run_id": "b", "dataset": {"path": "/b.jsonl"}}])
    pool, engine = started(config)
    try:
        assert [r.run_id for r in pool.runs()] == ["a", "b"] and engine.added == ["a", "b"]
        assert [r.actor.engine.run_id for r in pool.runs()] == ["a", "b"]  # each its own view
        assert all(r.state == "running" for r in pool.runs())
        status = pool.add(run_config("c", max_inflight_prompts=4))
        assert (status["run_id"], status["state"], status["max_inflight_prompts"]) == ("c", "running", 4)
        assert status["groups_pushed"] == 3 and status["error"] is None
        b = pool.run("b")
        gone = pool.remove("b")
        assert gone["state"] == "removed" and not b.thread.is_alive() and b.actor.closed
        assert engine.dropped == ["b"] and [r.run_id for r in pool.runs()] == ["a", "c"]
        with pytest.raises(RunNotFound, match="'b'"):
            pool.remove("b")
        pool.add(run_config("b"))  # a removed run may come back
        assert [r.run_id for r in pool.runs()] == ["a", "c", "b"]
    finally:
        pool.close(5)
    assert all(r.actor.closed for r in pool.runs()) and not engine.shut  # a given engine is not ours


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (run_config("a"), "already served"),
        (run_config("z", model_path="/other"), "not this pool's base model"),
        (run_config("z", engine={}), "full-weight and adapter runs cannot share a pool"),
        (run_config("z", runs=[{"run_id": "y", "dataset": {"path": "/y"}}]), "has no `runs` of its own"),
    ],
)
def test_a_run_that_cannot_join_is_refused_and_nothing_starts(config, match):
    pool, engine = started(run_config("a"))
    try:
        with pytest.raises(RunConflict, match=match):
            pool.add(config)
        assert [r.run_id for r in pool.runs()] == ["a"] and engine.added == ["a"]
    finally:
        pool.close(5)


def test_past_the_adapters_room_a_run_is_refused_with_the_setting_to_change():
    pool, _ = started(run_config("a", runs=[{"run_id": "b", "dataset": {"path": "/b"}}]))
    try:
        pool.add(run_config("c"))
        with pytest.raises(RunConflict, match=r"4 runs need 2 adapters .*max_cpu_loras >= 8"):
            pool.add(run_config("d"))
    finally:
        pool.close(5)


def test_a_pool_of_full_weights_serves_its_one_run():
    pool, engine = started(run_config("a", engine={}))
    try:
        assert pool.run("a").actor.engine is engine  # the engine itself: its weights are the run's
        with pytest.raises(RunConflict, match=r"several runs on one pool need engine\.lora"):
            pool.add(run_config("b", engine={}))
        pool.remove("a")
        engine.base_loads = 2  # it loaded run a's weights
        with pytest.raises(RunConflict, match="holds the weights of a run it served before"):
            pool.add(run_config("b", engine={}))
        assert engine.dropped == []
    finally:
        pool.close(5)


def test_a_run_changes_its_share_and_sampling_only():
    pool, _ = started(run_config("a"))
    run = pool.run("a")
    try:
        status = pool.update("a", {"max_inflight_prompts": 3, "sampling": {"temperature": 0.5}})
        assert status["max_inflight_prompts"] == 3
        (applied,) = run.actor.reconfigured
        assert applied.sampling.temperature == 0.5 and applied.sampling.n == 8  # merged, not replaced
        assert run.config == applied
        with pytest.raises(RunFieldFrozen, match=r"dataset.path, reward.name cannot change") as e:
            pool.update("a", {"dataset": {"path": "/x"}, "reward": {"name": "math_answer"}})
        assert e.value.fields == ["dataset.path", "reward.name"]
        with pytest.raises(pydantic.ValidationError, match=r"sampling\.temperature"):
            pool.update("a", {"sampling": {"temperature": -1}})
        assert len(run.actor.reconfigured) == 1 and run.config.sampling.temperature == 0.5
        pool.update("a", {"max_inflight_prompts": 3})  # nothing changes: nothing applied
        assert len(run.actor.reconfigured) == 1
        with pytest.raises(RunNotFound):
            pool.update("nope", {"max_inflight_prompts": 1})
    finally:
        pool.close(5)


def test_a_gateway_runs_sampling_does_not_change_under_its_open_episodes():
    pool, _ = started(run_config("a", gateway={"enabled": True}))
    try:
        with pytest.raises(RunFieldFrozen, match=r"gateway\.enabled"):
            pool.update("a", {"sampling": {"temperature": 0.5}})
        assert pool.update("a", {"max_inflight_prompts": 2})["max_inflight_prompts"] == 2
    finally:
        pool.close(5)


def test_a_run_whose_loop_dies_is_failed_alone():
    failed: list[tuple[str, str]] = []
    pool, _ = started(run_config("a"), on_failure=lambda run_id, exc: failed.append((run_id, str(exc))))
    try:
        pool.add(run_config("doomed-b"))
        wait_for(lambda: failed)  # the hook comes once the run is failed
        assert failed == [("doomed-b", "the reward module is gone")]
        assert pool.run("doomed-b").state == "failed"
        assert pool.run("doomed-b").status()["error"] == "RuntimeError: the reward module is gone"
        assert pool.run("a").state == "running"
        assert pool.run("doomed-b").registry.get_sample_value("offpolicy_actor_run_failed") == 1
        assert pool.run("a").registry.get_sample_value("offpolicy_actor_run_failed") == 0
        last = pool.remove("doomed-b")  # a failed run is removed like any, with its real last status
        assert (last["state"], last["error"]) == ("removed", "RuntimeError: the reward module is gone")
        assert [r.run_id for r in pool.runs()] == ["a"]
    finally:
        pool.close(5)


def test_a_failed_run_holds_its_share_until_removed_then_frees_it_at_once():
    """Three runs fill the adapters' room (max_cpu_loras 6); one whose loop died still holds its share (a
    fourth is refused) until DELETE, which frees it for the next run at once."""
    pool, _ = started(run_config("a", runs=[{"run_id": "b", "dataset": {"path": "/b"}}]))
    try:
        pool.add(run_config("doomed-c"))
        wait_for(lambda: pool.run("doomed-c").state == "failed")
        with pytest.raises(RunConflict, match=r"4 runs need"):
            pool.add(run_config("d"))
        pool.remove("doomed-c")
        assert pool.add(run_config("d"))["run_id"] == "d"
        assert [r.run_id for r in pool.runs()] == ["a", "b", "d"]
    finally:
        pool.close(5)


def test_removing_a_run_answers_what_it_served_before_its_adapters_left_the_engine():
    pool, engine = started(run_config("a"))
    try:
        last = pool.remove("a")
        assert (last["state"], last["loaded_policy_version"]) == ("removed", 7)
        assert engine.views["a"].dropped and engine.dropped == ["a"]  # and they did leave
    finally:
        pool.close(5)


def test_a_pool_that_builds_its_engine_stops_it(monkeypatch):
    built: list[StubEngine] = []

    def build(*args: Any) -> StubEngine:
        built.append(StubEngine(kind="lora"))
        return built[-1]

    monkeypatch.setattr("offpolicy.actors.rollout.pool.VLLMEngine", build)
    pool = Pool(run_config("a"), lambda run_id: CollectorRegistry(), actor_factory=IdleActor)
    pool.start()
    pool.close(5)
    assert len(built) == 1 and built[0].shut and built[0].added == ["a"]
