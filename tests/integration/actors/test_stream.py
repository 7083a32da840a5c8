"""The streaming actor loop on a fake engine (token by token, asyncio) and a real embedded Redis.

The fake engine samples one token per `STEP_S` per request, stamps each token with the version it holds
at that step, honours pause / abort / reload like `VLLMEngine`, and records how many requests it held at
once. It makes the loop's rules checkable in seconds: bounded in-flight prompts, a long prompt holding no
one back, one bad prompt skipped, each `reload.mode`'s versions, and no group lost while Redis refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ActorConfig
from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.actors.engine.adapters import Adapters
from offpolicy.actors.engine.vllm import Completion
from offpolicy.actors.errors import PromptFailed
from offpolicy.actors.rollout.actor import Actor
from offpolicy.buffer.errors import StorageUnavailable
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer, ReplayBuffer
from offpolicy.weights.manifest import weights_sha256, write_manifest
from offpolicy.weights.record import PolicyRecord, PolicyStore

pytestmark = [pytest.mark.redis]
STEP_S = 0.002
LONG = "toy-0"  # this prompt's completions are 20x longer than the others


class FakeEngine:
    kind, adapters = "full", None  # full weights (no engine.lora)

    def __init__(self, fail_prompt_len: int | None = None):
        self.tokenizer = lambda text, add_special_tokens=True: {"input_ids": [ord(c) % 97 for c in text]}
        self.loaded_version, self.loaded_path = 0, "/initial"
        self.running: set[str] = set()
        self.peak = 0
        self.finished: list[str] = []  # request ids in finishing order
        self._aborted: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.fail_prompt_len = fail_prompt_len
        self.long_len = -1  # prompt length of LONG (set by `_actor`)
        self.long_requests: set[str] = set()  # request ids of LONG
        self.running_at_reload: list[set[str]] = []  # the requests in flight at each reload

    async def acall(self, coro):
        return await coro

    def sampling_params(self, sampling, n=None, **overrides):
        return SimpleNamespace(n=sampling.n if n is None else n, max_tokens=sampling.max_tokens)

    async def generate_group(self, request_id, prompt_ids, params):
        if self.fail_prompt_len is not None and len(prompt_ids) == self.fail_prompt_len:
            raise PromptFailed(f"request {request_id}: refused")
        length = params.max_tokens * (20 if len(prompt_ids) == self.long_len else 1)
        if len(prompt_ids) == self.long_len:
            self.long_requests.add(request_id)
        self.running.add(request_id)
        self.peak = max(self.peak, len(self.running))
        versions: list[int] = []
        try:
            while len(versions) < length and request_id not in self._aborted:
                await self._resumed.wait()
                await asyncio.sleep(STEP_S)
                if self._resumed.is_set():  # a step sampled under the weights held now
                    versions.append(self.loaded_version)
        finally:
            self.running.discard(request_id)
        self.finished.append(request_id)
        reason = "abort" if request_id in self._aborted else "length"
        ids = np.arange(len(versions), dtype=np.int32) % 50
        return [
            Completion(
                ids,
                np.full(len(ids), -0.5, np.float32),
                reason,
                "a" * len(ids),
                np.asarray(versions, np.int32),
            )
            for _ in range(params.n)
        ]

    async def abort(self, request_ids):
        self._aborted.update(request_ids)

    @contextlib.asynccontextmanager
    async def paused(self):
        self._resumed.clear()
        try:
            yield
        finally:
            self._resumed.set()

    async def reload_weights(self, path, version, timeout_s=None, source=None):
        self.running_at_reload.append(set(self.running))
        await asyncio.sleep(0.01)
        self.loaded_version, self.loaded_path = version, source or path


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_target_token_dataset(tmp_path / "toy.jsonl", 24)


def _actor(dataset, redis_url, run_id, engine, **over) -> Actor:
    cfg = ActorConfig.model_validate(
        {
            "redis_url": redis_url,
            "run_id": run_id,
            "model_path": "/unused",
            "sampling": {"temperature": 0.7, "max_tokens": 8, "n": 2},
            "dataset": {"path": str(dataset), "shuffle": False, "max_epochs": 1, "chat_template": False},
            "reward": {"name": "target_token_share"},
            "max_inflight_prompts": 4,
            "reload": {"poll_interval_s": 0.05},
            "retry": {"initial_s": 0.02, "max_s": 0.1},
        }
        | over
    )
    actor = Actor(cfg, CollectorRegistry(), engine=engine)
    engine.long_len = len(
        actor.generation.encode(next(p for p in actor.prompts if p.prompt_id == LONG), actor.config.sampling)
    )
    return actor


def _groups(redis_url, run_id):
    with ReplayBuffer(redis_url, run_id) as buf:
        n = buf.stats().size
        return buf.sample(n, consumer_version=10**6, timeout_s=5.0) if n else []


def _publish(tmp_path, redis_url, run_id, version: int) -> None:
    folder = tmp_path / f"v{version}"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w" * (100 + version))
    write_manifest(folder, version)
    store = PolicyStore(redis_url, run_id)
    store.publish(PolicyRecord(version, f"file://{folder}", weights_sha256(folder), time.time()))
    store.close()


async def test_stream_keeps_the_engine_full_and_a_long_prompt_holds_no_one_back(dataset, redis_url, run_id):
    engine = FakeEngine()
    actor = _actor(dataset, redis_url, run_id, engine)
    await actor.arun(threading.Event())
    groups = _groups(redis_url, run_id)
    assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in actor.prompts)
    assert actor.groups_pushed == 24 and engine.peak == 4
    # the long prompt was admitted first, and 20 short ones finished while it ran (batch: at most 3)
    long_rank = [g.prompt_id for g in sorted(groups, key=lambda g: g.created_at)].index(LONG)
    assert long_rank >= 20
    assert all(g.policy_version == 0 and all(t.versions is None for t in g.trajectories) for g in groups)


async def test_a_failing_prompt_is_counted_and_skipped(dataset, redis_url, run_id):
    engine = FakeEngine()
    actor = _actor(dataset, redis_url, run_id, engine)
    bad = actor.prompts[3]
    engine.fail_prompt_len = len(actor.generation.encode(bad, actor.config.sampling))
    await actor.arun(threading.Event())
    refused = {
        p.prompt_id
        for p in actor.prompts
        if len(actor.generation.encode(p, actor.config.sampling)) == engine.fail_prompt_len
    }
    pushed = {g.prompt_id for g in _groups(redis_url, run_id)}
    assert pushed == {p.prompt_id for p in actor.prompts} - refused and bad.prompt_id in refused
    failures = actor.registry.get_sample_value("offpolicy_actor_failures_total", {"reason": "engine_error"})
    assert failures == len(refused)


async def _run_with_update(actor, tmp_path, redis_url, run_id, engine) -> None:
    stop = threading.Event()
    task = asyncio.create_task(actor.arun(stop))
    while len(engine.finished) < 2:  # the long prompt is mid-way
        await asyncio.sleep(0.005)
    _publish(tmp_path, redis_url, run_id, 1)
    await asyncio.wait_for(task, 60)


@pytest.mark.parametrize("mode", ["drain", "abort", "inflight"])
async def test_reload_modes(mode, dataset, redis_url, run_id, tmp_path):
    engine = FakeEngine()
    actor = _actor(dataset, redis_url, run_id, engine, reload={"poll_interval_s": 0.05, "mode": mode})
    await _run_with_update(actor, tmp_path, redis_url, run_id, engine)
    reg = actor.registry
    groups = _groups(redis_url, run_id)
    assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in actor.prompts)  # none lost
    assert engine.loaded_version == 1 and actor.sync.reloads == 1
    assert reg.get_sample_value("offpolicy_actor_reload_pause_seconds_count") == 1
    pause = reg.get_sample_value("offpolicy_actor_reload_pause_seconds_sum")
    aborted = reg.get_sample_value("offpolicy_actor_aborted_tokens_total")
    spanning = [g for g in groups if g.trajectories[0].versions is not None]
    assert pause < 5.0  # a hang guard only: what each mode waits for is checked below
    if mode == "inflight":
        # updated in place: the long prompt was still generating at the reload (not drained first)
        assert spanning and aborted == 0
        assert len(engine.running_at_reload) == 1 and engine.long_requests
        assert engine.long_requests <= engine.running_at_reload[0]
        for g in spanning:  # the oldest token's version is the group's; later tokens are newer
            for t in g.trajectories:
                assert t.versions[0] == g.policy_version == 0 and t.versions[-1] == 1
                assert np.all(np.diff(t.versions) >= 0)
    else:
        assert not spanning and engine.running_at_reload == [set()]  # drained (or aborted) first
    if mode == "abort":
        assert aborted > 0
    if mode == "drain":
        assert aborted == 0 and pause > 10 * STEP_S  # waited for the long prompt to finish


class AdapterEngine(FakeEngine):
    """Serves LoRA adapters: a new one is registered without a pause; a request keeps its adapter."""

    kind = "lora"

    def __init__(self) -> None:
        super().__init__()
        self.adapters = Adapters()
        self.running_at_load: list[set[str]] = []

    async def generate_group(self, request_id, prompt_ids, params):
        version = self.loaded_version  # the adapter the request carries, to its end
        out = await super().generate_group(request_id, prompt_ids, params)
        return [dataclasses.replace(c, versions=np.full(len(c.token_ids), version, np.int32)) for c in out]

    @contextlib.asynccontextmanager
    async def paused(self):
        raise AssertionError("an adapter is loaded without pausing the engine")
        yield

    async def load_adapter(self, path, version, timeout_s=None):
        self.running_at_load.append(set(self.running))
        self.loaded_version, self.loaded_path = version, path


async def test_an_adapter_is_taken_at_once_without_a_drain(dataset, redis_url, run_id, tmp_path):
    """`engine.lora` with `reload.mode: drain`: the adapter is registered while the long prompt still runs
    (no drain, no pause, nothing aborted); every group is one version, the versions of its requests."""
    engine = AdapterEngine()
    actor = _actor(dataset, redis_url, run_id, engine, reload={"poll_interval_s": 0.05, "mode": "drain"})
    stop = threading.Event()
    task = asyncio.create_task(actor.arun(stop))
    while len(engine.finished) < 2:  # the long prompt is mid-way
        await asyncio.sleep(0.005)
    folder = tmp_path / "v1"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"a" * 64)
    (folder / "adapter_config.json").write_text("{}")
    write_manifest(folder, 1)
    store = PolicyStore(redis_url, run_id)
    store.publish(PolicyRecord(1, f"file://{folder}", weights_sha256(folder), time.time(), "lora"))
    store.close()
    await asyncio.wait_for(task, 60)
    groups = _groups(redis_url, run_id)
    assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in actor.prompts)
    assert engine.loaded_version == 1 and engine.long_requests <= engine.running_at_load[0]
    assert actor.registry.get_sample_value("offpolicy_actor_aborted_tokens_total") == 0
    assert actor.registry.get_sample_value("offpolicy_actor_adapter_loads_total") == 1
    assert all(t.versions is None for g in groups for t in g.trajectories)  # each group: one version
    assert {g.policy_version for g in groups} == {0, 1}
    assert actor.status()["policy_kind"] == "lora"


async def test_groups_are_kept_while_redis_refuses_inserts(dataset, redis_url, run_id, monkeypatch):
    real, calls = AsyncReplayBuffer.insert_many, {"n": 0}

    async def flaky(self, groups):
        calls["n"] += 1
        if calls["n"] <= 5:
            raise StorageUnavailable("injected outage")
        return await real(self, groups)

    monkeypatch.setattr(AsyncReplayBuffer, "insert_many", flaky)
    engine = FakeEngine()
    actor = _actor(dataset, redis_url, run_id, engine)
    await actor.arun(threading.Event())
    assert sorted(g.prompt_id for g in _groups(redis_url, run_id)) == sorted(
        p.prompt_id for p in actor.prompts
    )
    reg = actor.registry
    assert reg.get_sample_value("offpolicy_actor_failures_total", {"reason": "redis_unavailable"}) == 5
    assert (
        reg.get_sample_value("offpolicy_actor_buffer_wait_seconds_total", {"reason": "redis_unavailable"}) > 0
    )


async def test_the_loop_keeps_admitting_while_a_version_is_read_ahead(
    redis_url, run_id, tmp_path, monkeypatch
):
    """The new version's files are read in the background: prompts keep being admitted (more requests
    finish than were in flight when the read began) and the engine is paused only once it is done."""
    import offpolicy.actors.transport.weight_sync as weight_sync

    started, release = threading.Event(), threading.Event()
    real = weight_sync.prefetch_folder

    def slow_volume(*args, **kwargs):
        started.set()
        assert release.wait(30), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(weight_sync, "prefetch_folder", slow_volume)
    engine = FakeEngine()
    actor = _actor(write_target_token_dataset(tmp_path / "toy.jsonl", 80), redis_url, run_id, engine)
    task = asyncio.create_task(actor.arun(threading.Event()))

    async def until(cond, what):
        deadline = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < deadline and not task.done(), f"timed out waiting for {what}"
            await asyncio.sleep(0.005)

    await until(lambda: len(engine.finished) >= 2, "the first requests")
    _publish(tmp_path, redis_url, run_id, 1)
    await until(started.is_set, "the read ahead")
    at_start = len(engine.finished)
    await until(lambda: len(engine.finished) >= at_start + 8, "admissions during the read")  # 4 in flight
    assert engine.loaded_version == 0 and engine.running_at_reload == []  # not paused meanwhile
    release.set()
    await asyncio.wait_for(task, 60)
    assert engine.loaded_version == 1 and actor.sync.reloads == 1


async def test_a_reconfigured_actor_admits_with_its_new_share_and_stamps_each_group_with_its_sampling(
    dataset, redis_url, run_id
):
    """An actor pool's run changed while it runs (`Actor.reconfigure`): prompts admitted from then on use
    the new `max_inflight_prompts` and `sampling`; every group is stamped with the sampling its request was
    admitted with (here `max_tokens`, which the fake engine generates exactly), never the newer one."""
    from offpolicy.config.loader import merge

    engine = FakeEngine()
    actor = _actor(dataset, redis_url, run_id, engine)
    task = asyncio.create_task(actor.arun(threading.Event()))
    while len(engine.finished) < 3:
        await asyncio.sleep(0.005)
    patch = {"max_inflight_prompts": 1, "sampling": {"max_tokens": 4}}
    await actor._reconfigure(ActorConfig.model_validate(merge(actor.config.model_dump(), patch)))
    admitted_before = set(engine.running)
    while engine.running & admitted_before:
        await asyncio.sleep(0.005)
    engine.peak = 0
    await asyncio.wait_for(task, 60)
    assert engine.peak == 1, "one prompt in the engine at a time from the change on"
    groups = _groups(redis_url, run_id)
    assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in actor.prompts)
    for g in groups:
        length = len(g.trajectories[0].response_ids) // (20 if g.prompt_id == LONG else 1)
        assert g.sampling.max_tokens == length, (g.prompt_id, g.sampling.max_tokens, length)
    assert {g.sampling.max_tokens for g in groups} == {8, 4}
