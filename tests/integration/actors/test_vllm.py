"""The actor on real vLLM (CPU, tiny float32 model) and real embedded Redis; one engine for the module.

The engine starts once (~45 s) and the tests share it, in any order: the reload test leaves the engine on
the weights it loaded; a test that needs the starting weights asks for `original_engine` (it reloads
`model_dir` as version 0 when the engine holds anything else), the others read the engine's version.
The agents' tests (environments, the gateway) are in test_agents_vllm.py; the helpers in
actor_run.py.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import DatasetConfig, ReloadConfig, SamplingConfig
from offpolicy.actors.data.prompts import load_prompts
from offpolicy.actors.rollout.actor import Actor
from offpolicy.actors.rollout.rewards import target_token_share
from offpolicy.actors.transport.weight_sync import weights_path
from offpolicy.buffer.codec import decode_group, encode_group
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.model import load_model
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.weights.manifest import write_manifest
from offpolicy.weights.record import PolicyStore
from tests.integration.actors.actor_run import (
    NUM_PROMPTS,
    TEMPERATURE,
    actor_config,
    drain,
    learner_logprobs,
    run_in_thread,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

# --- the tests


def test_behaviour_logprobs_match_the_learner_at_temperature(original_engine, model_dir):
    engine = original_engine
    tok = engine.tokenizer
    prompts = [np.asarray(tok(t)["input_ids"], np.int32) for t in ("hello world", "abc", "Only a: aaa")]
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=24, n=3)
    out = engine.generate(prompts, sampling)
    groups = [
        TrajectoryGroup(
            uuid.uuid4().hex,
            str(i),
            p,
            0,
            "t",
            0.0,
            SamplingParams(TEMPERATURE, 1.0, -1, 24),
            [Trajectory(c.token_ids, c.behavior_logprobs, 0.0, c.finish_reason) for c in cs],
        )
        for i, (p, cs) in enumerate(zip(prompts, out, strict=True))
    ]
    lp, behaviour, mask = learner_logprobs(model_dir, groups)
    assert mask.sum() >= 3 * 3 * 10
    assert float(((lp - behaviour).abs() * mask).max()) < 1e-4
    # raw (temperature-1) log-probs are a different distribution: this is what the test guards against
    raw, _, _ = learner_logprobs(model_dir, groups, temperature=1.0)
    assert float(((raw - behaviour).abs() * mask).max()) > 0.05


async def test_one_epoch_pushes_every_prompt_as_a_valid_group(engine, model_dir, dataset, redis_url, run_id):
    registry = CollectorRegistry()
    cfg = actor_config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        dataset=DatasetConfig(path=str(dataset), chat_template=False, max_epochs=1),
    )
    actor = Actor(cfg, registry, engine=engine)
    await actor.arun(threading.Event())
    groups = drain(redis_url, run_id, engine.loaded_version)
    prompts = {p.prompt_id: p for p in load_prompts(dataset)}
    assert sorted(g.prompt_id for g in groups) == sorted(prompts)
    assert (
        actor.status()["groups_pushed"]
        == NUM_PROMPTS
        == registry.get_sample_value("offpolicy_actor_groups_pushed_total")
    )
    tokens = 0
    for g in groups:
        decode_group(encode_group(g))  # round-trips through the validating codec
        assert (g.policy_version, g.actor_id, len(g.trajectories)) == (engine.loaded_version, "actor-0", 2)
        assert g.sampling == SamplingParams(TEMPERATURE, 1.0, -1, 16)
        assert engine.tokenizer.decode(g.prompt_ids) == prompts[g.prompt_id].text
        for t in g.trajectories:
            text = engine.tokenizer.decode(t.response_ids, skip_special_tokens=True)
            assert t.reward == pytest.approx(target_token_share(text, "a", {}))
            assert np.all(t.behavior_logprobs <= 0) and np.all(np.isfinite(t.behavior_logprobs))
            tokens += len(t.response_ids)
    assert registry.get_sample_value("offpolicy_actor_generated_tokens_total") == tokens
    assert actor.status()["state"] == "stopped"


def test_inflight_reload_mid_completion_matches_the_learner_token_by_token(
    original_engine, model_dir, dataset, redis_url, run_id, tmp_path
):
    """reload.mode=inflight: sequences continue under the new weights; the learner's log-prob of each token
    under the version the actor recorded for it equals the behaviour log-prob (the correction stays exact)."""
    engine = original_engine
    start_version = engine.loaded_version
    assert start_version == 0  # the engine holds `model_dir` (`original_engine`)
    cfg = actor_config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        sampling=SamplingConfig(temperature=TEMPERATURE, max_tokens=96, n=2),
        reload=ReloadConfig(poll_interval_s=0.2, mode="inflight", verify="manifest"),
    )
    actor = Actor(cfg, CollectorRegistry(), engine=engine)
    thread, stop, errors = run_in_thread(actor)
    try:
        wait_until(lambda: actor.groups_pushed >= 4 or errors, 120, "groups from the starting weights")
        model = load_model(model_dir, device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        new_version = start_version + 3
        store = PolicyStore(redis_url, run_id)
        record = publish_weights(model, tmp_path / "weights", new_version)
        write_manifest(weights_path(record.weights_uri), new_version)  # what the learner's writer adds
        store.publish(record)
        store.close()
        wait_until(lambda: engine.loaded_version == new_version or errors, 120, "the reload")
        pushed_at_reload = actor.groups_pushed
        wait_until(lambda: actor.groups_pushed >= pushed_at_reload + 8 or errors, 120, "groups after it")
    finally:
        stop.set()
        thread.join(60)
    assert not errors and not thread.is_alive()
    status = actor.status()
    assert status["loaded_policy_version"] == status["learner_policy_version"] == new_version
    assert status["reloads"] == 1
    pause = actor.registry.get_sample_value("offpolicy_actor_reload_pause_seconds_count")
    assert pause == 1
    groups = drain(redis_url, run_id, new_version)
    spanning = [g for g in groups if g.trajectories[0].versions is not None]
    assert spanning, "no completion was in flight across the update"
    for g in spanning:
        assert g.policy_version == start_version
        assert {int(v) for t in g.trajectories for v in t.versions} <= {start_version, new_version}
    versions = collate(groups, pad_token_id=0).versions  # (B, R)
    weights = {start_version: model_dir, new_version: record.weights_uri}
    for version, folder in weights.items():
        lp, behaviour, mask = learner_logprobs(folder, groups)
        mine = mask * (versions == version)  # the tokens this version sampled
        others = mask * (versions != version)
        assert mine.sum() >= 20 and others.sum() >= 20
        assert float(((lp - behaviour).abs() * mine).max()) < 1e-4
        assert float(((lp - behaviour).abs() * others).max()) > 1e-3  # the other version's tokens differ
    # inside the spanning completions themselves, token by token
    lp_new, behaviour, mask = learner_logprobs(record.weights_uri, spanning)
    lp_old, _, _ = learner_logprobs(weights[start_version], spanning)
    bver = collate(spanning, pad_token_id=0).versions
    expected = torch.where(bver == new_version, lp_new, lp_old)
    assert float(((expected - behaviour).abs() * mask).max()) < 1e-4


def test_actor_survives_redis_going_away_and_coming_back(engine, model_dir, dataset, tmp_path):
    server = EmbeddedRedis.start(tmp_path / "redis", appendfsync="always")
    registry = CollectorRegistry()
    cfg = actor_config(model_dir, dataset, server.url, "outage", buffer={"storage_timeout_s": 0.5})
    actor = Actor(cfg, registry, engine=engine)
    thread, stop, errors = run_in_thread(actor)
    try:
        wait_until(lambda: actor.groups_pushed >= 4 or errors, 120, "groups before the outage")
        server.stop()

        def failures() -> float:
            return registry.get_sample_value(
                "offpolicy_actor_failures_total", {"reason": "redis_unavailable"}
            )

        wait_until(lambda: failures() >= 2 or errors, 60, "the actor to notice the outage")
        assert thread.is_alive() and not errors
        server.restart()
        before = actor.groups_pushed
        wait_until(lambda: actor.groups_pushed >= before + 8 or errors, 120, "pushes after Redis came back")
    finally:
        stop.set()
        thread.join(60)
        pushed = actor.groups_pushed
        groups = drain(server.url, "outage", engine.loaded_version) if server.pid else []
        server.stop()
    assert not errors and not thread.is_alive()
    waited = registry.get_sample_value(
        "offpolicy_actor_buffer_wait_seconds_total", {"reason": "redis_unavailable"}
    )
    assert waited > 0
    assert len(groups) == pushed and len({g.group_id for g in groups}) == pushed


def _wait_for_evals(store, n: int) -> bool:
    wait_until(lambda: len(store.after("0")) >= n, 60, f"{n} evaluation(s)")
    return True


def test_an_evaluation_actor_evaluates_published_versions_and_pushes_nothing(
    original_engine, model_dir, dataset, redis_url, run_id, tmp_path
):
    """`mode: eval`: the actor evaluates the version it holds, then each published multiple of
    `every_versions` (loads waiting for an evaluation in progress), records each in the run's evaluation
    stream, and pushes nothing to the buffer."""
    from offpolicy.buffer.evaluations import EvalStore

    cfg = actor_config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        mode="eval",
        dataset=None,
        eval={
            "dataset": {"path": str(dataset)},
            "every_versions": 2,
            "samples_per_prompt": 3,
            "max_prompts": 5,
            "pass_threshold": 0.1,
        },
    )
    actor = Actor(cfg, CollectorRegistry(), engine=original_engine)
    thread, stop, errors = run_in_thread(actor)
    store = EvalStore(redis_url, run_id)
    try:
        wait_until(lambda: len(store.after("0")) >= 1, 60, "the first evaluation")
        assert _wait_for_evals(store, 1) and len(store.after("0")) == 1  # v1 is not a multiple of 2
        for version in (1, 2):  # the same weights published as v1 (not evaluated), then v2
            record = publish_weights(load_model(model_dir, device="cpu"), tmp_path / "weights", version)
            write_manifest(weights_path(record.weights_uri), version)
            policy = PolicyStore(redis_url, run_id)
            policy.publish(record)
            policy.close()
            wait_until(lambda v=version: actor.engine.loaded_version == v or errors, 60, f"v{version} loaded")
        wait_until(lambda: len(store.after("0")) >= 2, 60, "the evaluation of v2")
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors
    records = [r for _, r in store.after("0")]
    assert [r.policy_version for r in records] == [0, 2]
    for r in records:
        assert r.prompts == 5 and r.samples_per_prompt == 3 and r.failed == 0
        assert 0.0 <= r.pass_at["1"] <= r.pass_at["3"] <= 1.0 and 0.0 <= r.reward_mean <= 1.0
    assert actor.status()["last_eval"]["eval/policy_version"] == 2.0
    with ReplayBuffer(redis_url, run_id) as buf:
        assert buf.stats().size == 0
