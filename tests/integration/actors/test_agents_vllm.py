"""Agents on the actor with real vLLM (CPU, tiny float32 model) and real embedded Redis: an environment's
multi-turn episodes, and an OpenAI client's tool episode through the gateway; each recorded exactly (the
policy tokens as the engine returned them, the learner's log-probs equal to the engine's on them)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import DatasetConfig, SamplingConfig
from offpolicy.actors.rollout.actor import Actor
from offpolicy.buffer.replay_buffer import ReplayBuffer
from tests.integration.actors.actor_run import (
    NUM_PROMPTS,
    TEMPERATURE,
    actor_config,
    drain,
    learner_logprobs,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]


async def test_an_environment_records_policy_and_environment_tokens_exactly(
    original_engine, model_dir, dataset, redis_url, run_id
):
    """Three-turn episodes of the guessing game: the user's turns are the chat template's tokens, masked
    as the environment's; at equal weights the learner's log-probs of the policy's tokens, with the user's
    turns in the context, are the engine's behaviour log-probs."""
    from offpolicy.actors.rollout.episodes import render_message

    cfg = actor_config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        environment={"name": "offpolicy.actors.rollout.environments.guessing_game"},
        sampling=SamplingConfig(temperature=TEMPERATURE, max_tokens=80, n=2),  # 3 turns of 6 + 2 replies
        dataset=DatasetConfig(path=str(dataset), chat_template=False, max_epochs=1),
    )
    actor = Actor(cfg, CollectorRegistry(), engine=original_engine)
    await actor.arun(threading.Event())
    groups = drain(redis_url, run_id, original_engine.loaded_version)
    assert len(groups) == NUM_PROMPTS
    tok = original_engine.tokenizer
    replies = {tuple(render_message(tok, "user", word)) for word in ("warmer", "colder")}
    for g in groups:
        for t in g.trajectories:
            env = ~t.policy_mask
            runs = np.split(t.response_ids[env], np.flatnonzero(np.diff(np.flatnonzero(env)) > 1) + 1)
            assert len(runs) == 2 and all(tuple(r.tolist()) in replies for r in runs)  # two user turns
            assert (t.behavior_logprobs[env] == 0).all()
    lp, behaviour, mask = learner_logprobs(model_dir, groups)
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
    from openai import ConflictError, OpenAI, UnprocessableEntityError

    from offpolicy.actors.engine.chat import render_messages, render_prompt
    from offpolicy.services.actor_api.main import create_app
    from offpolicy.services.common.settings import ActorServiceSettings

    cfg = actor_config(
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
    app = create_app(settings, config=cfg, engine=original_engine)  # the pool's engine: the module's
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    tok, auth = original_engine.tokenizer, {"Authorization": "Bearer s3cret"}
    with TestClient(app) as http:
        wait_until(lambda: http.get("/readyz").status_code == 200, 60, "the actor service")
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
        r = client.chat.completions.create(
            model="offpolicy", messages=first, max_tokens=8, extra_headers=headers
        )
        with pytest.raises(ConflictError):  # a call that rewrites the recorded assistant turn: 409
            rewritten = {"role": "assistant", "content": r.choices[0].message.content + "!"}
            bad = [*first, rewritten, {"role": "user", "content": "?"}]
            client.chat.completions.create(model="offpolicy", messages=bad, extra_headers=headers)
        follow = [
            *first,
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "?"},
        ]
        with pytest.raises(UnprocessableEntityError):  # vLLM's own check, before anything is recorded
            client.chat.completions.create(
                model="offpolicy", messages=follow, stop=[""], extra_headers=headers
            )
        again = client.chat.completions.create(
            model="offpolicy", messages=follow, max_tokens=8, extra_headers=headers
        )
        assert again.choices[0].finish_reason in ("stop", "length")  # the corrected retry goes on
        wait_until(lambda: ReplayBuffer(redis_url, run_id).stats().size == 1, 30, "the group in the buffer")
    (group,) = drain(redis_url, run_id, original_engine.loaded_version)
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
    lp, behaviour, mask = learner_logprobs(model_dir, [group])
    assert float(((lp - behaviour).abs() * mask).max()) < 1e-4
