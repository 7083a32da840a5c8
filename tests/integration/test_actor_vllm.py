"""The actor on real vLLM (CPU, tiny float32 model) and real embedded Redis; one engine for the module.

The engine starts once (~45 s) and the tests share it, in any order: the reload test leaves the engine on
the weights it loaded; a test that needs the starting weights asks for `original_engine` (it reloads
`model_dir` as version 0 when the engine holds anything else), the others read the engine's version.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from actors.config import ActorConfig, DatasetConfig, EngineConfig, ReloadConfig, RetryConfig, SamplingConfig
from actors.engine import VLLMEngine
from actors.manifest import write_manifest
from actors.prompts import load_prompts
from actors.rewards import target_token_share
from actors.toy import write_target_token_dataset
from actors.weight_sync import weights_path
from actors.worker import Actor
from buffer.codec import decode_group, encode_group
from buffer.embedded import EmbeddedRedis
from buffer.policy import PolicyStore
from buffer.replay_buffer import ReplayBuffer
from buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from learner.batch import collate
from learner.model import load_model, make_tiny_model
from learner.model.policy import token_logprobs
from learner.persist.weights import publish_weights

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

TEMPERATURE = 0.7
NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> VLLMEngine:
    eng = VLLMEngine(EngineConfig.cpu_tiny(max_model_len=256), str(model_dir))
    yield eng
    eng.shutdown()


@pytest.fixture
def original_engine(engine: VLLMEngine, model_dir: Path) -> VLLMEngine:
    """The module's engine holding `model_dir` as version 0, whatever an earlier test loaded into it."""
    if (engine.loaded_version, engine.loaded_path) != (0, str(model_dir)):

        async def restore() -> None:
            async with engine.paused():
                await engine.reload_weights(str(model_dir), 0)

        engine.call(restore())
    return engine


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_target_token_dataset(tmp_path_factory.mktemp("data") / "toy.jsonl", NUM_PROMPTS)


def _config(model_dir, dataset_path, redis_url, run_id, **over) -> ActorConfig:
    base = {
        "redis_url": redis_url,
        "run_id": run_id,
        "model_path": str(model_dir),
        "engine": EngineConfig.cpu_tiny(max_model_len=256),
        "sampling": SamplingConfig(temperature=TEMPERATURE, max_tokens=16, n=2),
        "dataset": DatasetConfig(path=str(dataset_path), chat_template=False),
        "reward": {"name": "target_token_share"},
        "reload": ReloadConfig(poll_interval_s=0.2),
        "retry": RetryConfig(initial_s=0.1, max_s=0.5),
    }
    return ActorConfig.model_validate(base | over)


def _learner_logprobs(
    model_path: str | Path, groups: list[TrajectoryGroup], temperature: float | None = None
):
    """(learner log-probs, behaviour log-probs, mask) with the learner's own collate + token_logprobs."""
    batch = collate(groups, pad_token_id=0)
    if temperature is not None:
        batch.temperatures = torch.full_like(batch.temperatures, temperature)
    model = load_model(model_path, device="cpu").eval()
    with torch.no_grad():
        lp = token_logprobs(model, batch)  # (B, R)
    return lp, batch.rollout_log_probs, batch.response_mask


def _drain(redis_url: str, run_id: str, consumer_version: int) -> list[TrajectoryGroup]:
    with ReplayBuffer(redis_url, run_id) as buf:
        n = buf.stats().size
        return buf.sample(n, consumer_version=consumer_version, timeout_s=5.0) if n else []


def _run_in_thread(actor: Actor) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    stop, errors = threading.Event(), []

    def main():
        try:
            actor.run(stop)
        except BaseException as e:  # handed to the test thread, which fails with it
            errors.append(e)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, stop, errors


def _wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


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
            [Trajectory(c.token_ids, c.logprobs, 0.0, c.finish_reason) for c in cs],
        )
        for i, (p, cs) in enumerate(zip(prompts, out, strict=True))
    ]
    lp, behaviour, mask = _learner_logprobs(model_dir, groups)
    assert mask.sum() >= 3 * 3 * 10
    assert float(((lp - behaviour).abs() * mask).max()) < 1e-4
    # raw (temperature-1) log-probs are a different distribution: this is what the test guards against
    raw, _, _ = _learner_logprobs(model_dir, groups, temperature=1.0)
    assert float(((raw - behaviour).abs() * mask).max()) > 0.05


async def test_one_epoch_pushes_every_prompt_as_a_valid_group(engine, model_dir, dataset, redis_url, run_id):
    registry = CollectorRegistry()
    cfg = _config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        dataset=DatasetConfig(path=str(dataset), chat_template=False, max_epochs=1),
    )
    actor = Actor(cfg, registry, engine=engine)
    await actor.arun(threading.Event())
    groups = _drain(redis_url, run_id, engine.loaded_version)
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
    cfg = _config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        sampling=SamplingConfig(temperature=TEMPERATURE, max_tokens=96, n=2),
        reload=ReloadConfig(poll_interval_s=0.2, mode="inflight", verify="manifest"),
    )
    actor = Actor(cfg, CollectorRegistry(), engine=engine)
    thread, stop, errors = _run_in_thread(actor)
    try:
        _wait_until(lambda: actor.groups_pushed >= 4 or errors, 120, "groups from the starting weights")
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
        _wait_until(lambda: engine.loaded_version == new_version or errors, 120, "the reload")
        pushed_at_reload = actor.groups_pushed
        _wait_until(lambda: actor.groups_pushed >= pushed_at_reload + 8 or errors, 120, "groups after it")
    finally:
        stop.set()
        thread.join(60)
    assert not errors and not thread.is_alive()
    status = actor.status()
    assert status["loaded_policy_version"] == status["learner_policy_version"] == new_version
    assert status["reloads"] == 1
    pause = actor.registry.get_sample_value("offpolicy_actor_reload_pause_seconds_count")
    assert pause == 1
    groups = _drain(redis_url, run_id, new_version)
    spanning = [g for g in groups if g.trajectories[0].versions is not None]
    assert spanning, "no completion was in flight across the update"
    for g in spanning:
        assert g.policy_version == start_version
        assert {int(v) for t in g.trajectories for v in t.versions} <= {start_version, new_version}
    behaviour_versions = collate(groups, pad_token_id=0).behavior_versions  # (B, R)
    weights = {start_version: model_dir, new_version: record.weights_uri}
    for version, folder in weights.items():
        lp, behaviour, mask = _learner_logprobs(folder, groups)
        mine = mask * (behaviour_versions == version)  # the tokens this version sampled
        others = mask * (behaviour_versions != version)
        assert mine.sum() >= 20 and others.sum() >= 20
        assert float(((lp - behaviour).abs() * mine).max()) < 1e-4
        assert float(((lp - behaviour).abs() * others).max()) > 1e-3  # the other version's tokens differ
    # inside the spanning completions themselves, token by token
    lp_new, behaviour, mask = _learner_logprobs(record.weights_uri, spanning)
    lp_old, _, _ = _learner_logprobs(weights[start_version], spanning)
    bver = collate(spanning, pad_token_id=0).behavior_versions
    expected = torch.where(bver == new_version, lp_new, lp_old)
    assert float(((expected - behaviour).abs() * mask).max()) < 1e-4


def test_actor_survives_redis_going_away_and_coming_back(engine, model_dir, dataset, tmp_path):
    server = EmbeddedRedis.start(tmp_path / "redis", appendfsync="always")
    registry = CollectorRegistry()
    cfg = _config(model_dir, dataset, server.url, "outage", buffer={"storage_timeout_s": 0.5})
    actor = Actor(cfg, registry, engine=engine)
    thread, stop, errors = _run_in_thread(actor)
    try:
        _wait_until(lambda: actor.groups_pushed >= 4 or errors, 120, "groups before the outage")
        server.stop()

        def failures() -> float:
            return registry.get_sample_value(
                "offpolicy_actor_failures_total", {"reason": "redis_unavailable"}
            )

        _wait_until(lambda: failures() >= 2 or errors, 60, "the actor to notice the outage")
        assert thread.is_alive() and not errors
        server.restart()
        before = actor.groups_pushed
        _wait_until(lambda: actor.groups_pushed >= before + 8 or errors, 120, "pushes after Redis came back")
    finally:
        stop.set()
        thread.join(60)
        pushed = actor.groups_pushed
        groups = _drain(server.url, "outage", engine.loaded_version) if server.pid else []
        server.stop()
    assert not errors and not thread.is_alive()
    waited = registry.get_sample_value(
        "offpolicy_actor_buffer_wait_seconds_total", {"reason": "redis_unavailable"}
    )
    assert waited > 0
    assert len(groups) == pushed and len({g.group_id for g in groups}) == pushed


async def test_an_environment_records_policy_and_environment_tokens_exactly(
    original_engine, model_dir, dataset, redis_url, run_id
):
    """Three-turn episodes of the guessing game: the user's turns are the chat template's tokens, masked
    as the environment's; at equal weights the learner's log-probs of the policy's tokens, with the user's
    turns in the context, are the engine's behaviour log-probs."""
    from actors.episodes import render_message

    cfg = _config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        environment={"name": "actors.environments.guessing_game"},
        sampling=SamplingConfig(temperature=TEMPERATURE, max_tokens=80, n=2),  # 3 turns of 6 + 2 replies
        dataset=DatasetConfig(path=str(dataset), chat_template=False, max_epochs=1),
    )
    actor = Actor(cfg, CollectorRegistry(), engine=original_engine)
    await actor.arun(threading.Event())
    groups = _drain(redis_url, run_id, original_engine.loaded_version)
    assert len(groups) == NUM_PROMPTS
    tok = original_engine.tokenizer
    replies = {tuple(render_message(tok, "user", word)) for word in ("warmer", "colder")}
    for g in groups:
        for t in g.trajectories:
            env = ~t.policy_mask
            runs = np.split(t.response_ids[env], np.flatnonzero(np.diff(np.flatnonzero(env)) > 1) + 1)
            assert len(runs) == 2 and all(tuple(r.tolist()) in replies for r in runs)  # two user turns
            assert (t.behavior_logprobs[env] == 0).all()
    lp, behaviour, mask = _learner_logprobs(model_dir, groups)
    assert mask.sum() >= NUM_PROMPTS * 2 * 3  # at least a token per policy turn
    assert float(((lp - behaviour).abs() * mask).max()) < 1e-4


def test_the_gateway_records_an_openai_clients_tool_episode_exactly(
    original_engine, model_dir, redis_url, run_id
):
    """The `openai` client drives a three-turn tool episode through the actor service's gateway (no
    dataset: the gateway only). The recorded policy tokens are each call's tokens as the engine returned
    them, the tool and user messages are the chat template's tokens, masked; at equal weights the learner's
    log-probs of the policy's tokens (the environment's in context) are the behaviour log-probs."""
    from fastapi.testclient import TestClient
    from openai import ConflictError, OpenAI

    from actors.chat import render_messages, render_prompt
    from services.actor_api.main import create_app
    from services.common.settings import ActorServiceSettings

    cfg = _config(
        model_dir,
        None,
        redis_url,
        run_id,
        dataset=None,
        gateway={"enabled": True, "group_size": 2},
        tool_parser="hermes",
        sampling=SamplingConfig(temperature=TEMPERATURE, max_tokens=120, n=2),
    )
    settings = ActorServiceSettings(api_token="s3cret")
    app = create_app(settings, config=cfg, actor_factory=lambda c, r: Actor(c, r, engine=original_engine))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    tok, auth = original_engine.tokenizer, {"Authorization": "Bearer s3cret"}
    with TestClient(app) as http:
        _wait_until(lambda: http.get("/readyz").status_code == 200, 60, "the actor service")
        assert http.post("/v1/episodes", json={"prompt_id": "sum-1"}).status_code == 401
        client = OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=http, max_retries=0)
        recorded = []
        for _ in range(2):  # one group of two episodes
            opened = http.post("/v1/episodes", json={"prompt_id": "sum-1"}, headers=auth)
            eid = opened.json()["episode_id"]
            headers = {"X-Episode-Id": eid}
            messages = [{"role": "user", "content": "What is 2+3? Use the tool."}]
            turns = []
            for follow in (
                {"role": "tool", "content": "5", "tool_call_id": "call-0"},
                {"role": "user", "content": "so?"},
                None,
            ):
                r = client.chat.completions.create(
                    model="offpolicy",
                    messages=messages,
                    tools=tools,
                    logprobs=True,
                    max_tokens=8,
                    extra_headers=headers,
                )
                choice = r.choices[0]
                turns.append((choice.model_extra["token_ids"], [c.logprob for c in choice.logprobs.content]))
                messages.append(choice.message.model_dump(exclude_none=True))
                if follow is not None:
                    messages.append(follow)
            done = http.post(f"/v1/episodes/{eid}/finish", json={"reward": 0.5}, headers=auth)
            recorded.append((messages, turns))
        assert done.json()["group_complete"]
        third = http.post("/v1/episodes", json={"prompt_id": "sum-2"}, headers=auth)
        headers = {"X-Episode-Id": third.json()["episode_id"]}
        first = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model="offpolicy", messages=first, extra_headers=headers)
        with pytest.raises(ConflictError):  # a call that rewrites the recorded assistant turn: 409
            rewritten = {"role": "assistant", "content": r.choices[0].message.content + "!"}
            bad = [*first, rewritten, {"role": "user", "content": "?"}]
            client.chat.completions.create(model="offpolicy", messages=bad, extra_headers=headers)
        _wait_until(lambda: ReplayBuffer(redis_url, run_id).stats().size == 1, 30, "the group in the buffer")
    (group,) = _drain(redis_url, run_id, original_engine.loaded_version)
    assert group.prompt_ids.tolist() == render_prompt(tok, recorded[0][0][:1], tools)
    for t, (messages, turns) in zip(group.trajectories, recorded, strict=True):
        tool = render_messages(tok, [messages[2]], tools)
        user = render_messages(tok, [messages[4]], tools)
        (ids1, lp1), (ids2, lp2), (ids3, lp3) = turns
        assert t.response_ids.tolist() == ids1 + tool + ids2 + user + ids3
        assert t.policy_mask.tolist() == [True] * len(ids1) + [False] * len(tool) + [True] * len(ids2) + [
            False
        ] * len(user) + [True] * len(ids3)
        assert t.behavior_logprobs[t.policy_mask].tolist() == pytest.approx(lp1 + lp2 + lp3, abs=1e-6)
        assert t.reward == 0.5
    lp, behaviour, mask = _learner_logprobs(model_dir, [group])
    assert float(((lp - behaviour).abs() * mask).max()) < 1e-4


def _wait_for_evals(store, n: int) -> bool:
    _wait_until(lambda: len(store.after("0")) >= n, 60, f"{n} evaluation(s)")
    return True


def test_an_evaluation_actor_evaluates_published_versions_and_pushes_nothing(
    original_engine, model_dir, dataset, redis_url, run_id, tmp_path
):
    """`mode: eval`: the actor evaluates the version it holds, then each published multiple of
    `every_versions` (loads waiting for an evaluation in progress), records each in the run's evaluation
    stream, and pushes nothing to the buffer."""
    from buffer.evaluations import EvalStore

    cfg = _config(
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
    thread, stop, errors = _run_in_thread(actor)
    store = EvalStore(redis_url, run_id)
    try:
        _wait_until(lambda: len(store.after("0")) >= 1, 60, "the first evaluation")
        assert _wait_for_evals(store, 1) and len(store.after("0")) == 1  # v1 is not a multiple of 2
        for version in (1, 2):  # the same weights published as v1 (not evaluated), then v2
            record = publish_weights(load_model(model_dir, device="cpu"), tmp_path / "weights", version)
            write_manifest(weights_path(record.weights_uri), version)
            policy = PolicyStore(redis_url, run_id)
            policy.publish(record)
            policy.close()
            _wait_until(
                lambda v=version: actor.engine.loaded_version == v or errors, 60, f"v{version} loaded"
            )
        _wait_until(lambda: len(store.after("0")) >= 2, 60, "the evaluation of v2")
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
