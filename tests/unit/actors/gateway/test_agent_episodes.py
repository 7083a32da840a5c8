"""The gateway's episodes against a scripted engine: a three-turn tool episode recorded token for token
(policy turns as the engine returned them, tool and user messages as the chat template's tokens, masked),
prefix consistency, groups of episodes, expiry, rewards by the reward function, refused requests.
The same on real vLLM through the `openai` client: tests/integration/actors/test_agents_vllm.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ActorConfig, EngineConfig, GatewayConfig, SamplingConfig
from offpolicy.actors.engine.chat import new_messages, render_messages, render_prompt
from offpolicy.actors.engine.vllm import Completion, VLLMEngine
from offpolicy.actors.errors import (
    BudgetExceeded,
    ChatRequestError,
    EpisodeConflict,
    EpisodeNotFound,
    InvalidSampling,
    TooManyEpisodes,
)
from offpolicy.actors.gateway.agent_episodes import Gateway
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.scoring import RewardFailures, Scorer
from offpolicy.actors.rollout.submit import stamped_sampling
from offpolicy.learner.model import build_char_tokenizer

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


class ScriptedEngine:
    """Answers each request with the next scripted text (one token per character) and log-probs -0.5. Its
    sampling parameters are the real engine's (vLLM's `SamplingParams` and its own checks)."""

    kind, adapters = "full", None  # full weights (no engine.lora)

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tokenizer, self.script, self.loaded_version = tokenizer, list(script), 7
        self.requests: list[list[int]] = []

    def sampling_params(self, sampling: Any, n: int | None = None, **overrides: Any) -> Any:
        return VLLMEngine.sampling_params(self, sampling, n, **overrides)  # type: ignore[arg-type]

    async def generate_group(
        self, request_id: str, prompt_ids: Any, params: dict[str, Any]
    ) -> list[Completion]:
        self.requests.append(list(prompt_ids))
        text = self.script.pop(0)[: params.max_tokens]
        ids = np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
        lps = -0.5 - np.arange(len(ids), dtype=np.float32) / 100
        return [Completion(ids, lps, "stop", text, np.full(len(ids), self.loaded_version, np.int32))]

    async def acall(self, coro: Any) -> Any:
        return await coro


class StubActor:
    def __init__(self, script: list[str], **gateway: Any) -> None:
        self.config = ActorConfig(
            model_path="m",
            engine=EngineConfig(max_model_len=512),
            sampling=SamplingConfig(temperature=0.7, max_tokens=200, n=2),
            gateway=GatewayConfig(enabled=True, **gateway),
            tool_parser="hermes",
            reward={"name": "target_token_share"},
        )
        self.metrics = ActorMetrics(CollectorRegistry())
        self.engine = ScriptedEngine(build_char_tokenizer(), script)
        self.scorer = Scorer(self.config.reward)
        self.reward_failures = RewardFailures(self.metrics)
        self.actor_id, self.stamp = "actor-0", stamped_sampling(self.config.sampling)
        self.pushed: list[Any] = []

    def submit(self, group: Any) -> None:
        self.pushed.append(group)


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "offpolicy", "messages": messages, **extra}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_three_turn_tool_episode_is_recorded_exactly():
    actor = StubActor([CALL, "ok 5", "bye"])
    gw, tok = Gateway(actor), actor.engine.tokenizer

    async def episode() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        opened = await gw.open_episode("task-1", group_size=1)
        eid = opened["episode_id"]
        messages = [{"role": "user", "content": "add 2 and 3"}]
        r1 = await gw.chat(eid, body(messages, tools=TOOLS, logprobs=True))
        m1 = r1["choices"][0]["message"]
        assert r1["choices"][0]["finish_reason"] == "tool_calls" and not m1["content"]
        (call,) = m1["tool_calls"]
        assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {
            "a": 2,
            "b": 3,
        }
        lps = [c["logprob"] for c in r1["choices"][0]["logprobs"]["content"]]
        assert lps == pytest.approx((-0.5 - np.arange(len(CALL)) / 100).tolist())
        messages += [m1, {"role": "tool", "content": "5", "tool_call_id": call["id"]}]
        r2 = await gw.chat(eid, body(messages, tools=TOOLS))
        assert (
            r2["choices"][0]["message"]["content"] == "ok 5" and r2["choices"][0]["finish_reason"] == "stop"
        )
        messages += [r2["choices"][0]["message"], {"role": "user", "content": "thanks"}]
        r3 = await gw.chat(eid, body(messages, tools=TOOLS))
        assert r3["usage"]["completion_tokens"] == 3
        done = await gw.finish(eid, reward=0.75)
        return messages, done

    messages, done = run(episode())
    assert done["group_complete"]
    (group,) = actor.pushed
    prompt = render_prompt(tok, messages[:1], TOOLS)
    assert group.prompt_ids.tolist() == prompt
    tool = render_messages(tok, [messages[2]], TOOLS)
    user = render_messages(tok, [messages[4]], TOOLS)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    (t,) = group.trajectories
    expected = ids(CALL) + tool + ids("ok 5") + user + ids("bye")
    assert t.response_ids.tolist() == expected
    policy = [True] * len(CALL) + [False] * len(tool) + [True] * 4 + [False] * len(user) + [True] * 3
    assert t.policy_mask.tolist() == policy
    assert (t.behavior_logprobs[~t.policy_mask] == 0).all() and t.reward == 0.75 and group.policy_version == 7
    # each turn was sampled from exactly the recorded sequence before it
    assert actor.engine.requests[1] == prompt + ids(CALL) + tool
    assert actor.engine.requests[2] == prompt + expected[: len(expected) - 3]
    assert tok.decode(tool) == "tool: 5\nassistant: "


def test_a_call_that_rewrites_the_conversation_is_refused():
    actor = StubActor(["hello", "again", "x"])
    gw = Gateway(actor)

    async def go() -> None:
        eid = (await gw.open_episode("p"))["episode_id"]
        first = [{"role": "user", "content": "hi"}]
        r = await gw.chat(eid, body(first))
        reply = r["choices"][0]["message"]
        with pytest.raises(EpisodeConflict, match=r"messages\[1\]"):
            await gw.chat(
                eid,
                body([*first, {"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "?"}]),
            )
        with pytest.raises(EpisodeConflict, match="fewer"):
            await gw.chat(eid, body(first))
        with pytest.raises(EpisodeConflict, match="no message"):
            await gw.chat(eid, body([*first, reply]))
        # the refused calls left nothing behind: the right continuation still extends the record
        r2 = await gw.chat(eid, body([*first, reply, {"role": "user", "content": "?"}]))
        assert r2["choices"][0]["message"]["content"] == "again"

    run(go())
    assert len(actor.engine.requests) == 2


def test_requests_the_learner_could_not_correct_are_refused_with_their_field():
    actor = StubActor(["a"] * 5)
    gw = Gateway(actor)

    async def go() -> None:
        eid = (await gw.open_episode("p"))["episode_id"]
        msgs = [{"role": "user", "content": "hi"}]
        for extra, field in (
            ({"temperature": 1.0}, "temperature"),
            ({"top_p": 0.9}, "top_p"),
            ({"n": 2}, "n"),
            ({"stream": True}, "stream"),
            ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ):
            with pytest.raises(ChatRequestError) as e:
                await gw.chat(eid, body(msgs, **extra))
            assert e.value.field == field
        ok = await gw.chat(eid, body(msgs, temperature=0.7))  # the actor's own: fine
        assert ok["choices"][0]["message"]["content"] == "a"
        untracked = await gw.chat(None, body(msgs, temperature=1.3))  # not recorded: any sampling
        assert untracked["choices"][0]["message"]["content"] == "a"
        with pytest.raises(EpisodeNotFound):
            await gw.chat("abc", body(msgs))

    run(go())
    assert actor.pushed == []


def test_episodes_fill_groups_and_a_group_is_pushed_when_all_have_ended():
    actor = StubActor(["aaa", "ab", "b", "c"], episode_timeout_s=10.0)
    gw = Gateway(actor)

    async def go() -> None:
        e1 = await gw.open_episode("p", answer="a")
        e2 = await gw.open_episode("p", answer="a")
        e3 = await gw.open_episode("p", answer="a")  # the first group (n=2) is full: a new one
        assert e1["group_id"] == e2["group_id"] != e3["group_id"] and e1["group_size"] == 2
        await gw.chat(
            e1["episode_id"], body([{"role": "system", "content": "S1"}, {"role": "user", "content": "go"}])
        )
        await gw.chat(
            e2["episode_id"], body([{"role": "system", "content": "S2"}, {"role": "user", "content": "go"}])
        )
        assert not (await gw.finish(e1["episode_id"]))["group_complete"]  # no reward: the reward function
        assert actor.pushed == []
        assert (await gw.finish(e2["episode_id"]))["group_complete"]
        await gw.chat(e3["episode_id"], body([{"role": "user", "content": "go"}]))
        e4 = await gw.open_episode("p", group_id=e3["group_id"])
        with pytest.raises(EpisodeConflict, match="already has"):
            await gw.open_episode("p", group_id=e3["group_id"])
        # e3 goes quiet and expires; e4 finishes without a turn: nothing to train on, nothing pushed
        gw._episodes[e3["episode_id"]].last_active -= 11
        expired = gw.expire()
        assert expired == [] and actor.metrics.episodes.labels("expired")._value.get() == 1
        assert (await gw.finish(e4["episode_id"], reward=1.0))["group_complete"]

    run(go())
    (group,) = actor.pushed
    tok = actor.engine.tokenizer
    shared = tok.decode(group.prompt_ids.tolist())
    assert shared == "system: S"  # the longest common prefix of the two prompts
    a, b = group.trajectories
    assert [t.reward for t in group.trajectories] == pytest.approx([1.0, 0.5])  # share of "a"
    for t, digit, text in ((a, "1", "aaa"), (b, "2", "ab")):
        rest = f"{digit}\nuser: go\nassistant: "
        assert tok.decode(t.response_ids.tolist()) == rest + text
        assert t.policy_mask.tolist() == [False] * len(rest) + [True] * len(text)
    assert actor.metrics.episodes.labels("empty")._value.get() == 1
    assert group.metadata["gateway_group_id"]


def test_open_episodes_are_bounded():
    actor = StubActor([], max_open_episodes=2)
    gw = Gateway(actor)

    async def go() -> None:
        await gw.open_episode("a")
        await gw.open_episode("b")
        with pytest.raises(TooManyEpisodes):
            await gw.open_episode("c")

    run(go())


def test_new_messages_compares_tool_calls_by_value_not_formatting():
    recorded = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}
        ]},
    ]  # fmt: skip
    echoed = [
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "other", "type": "function", "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}
        ]},
        {"role": "tool", "content": "3", "tool_call_id": "1"},
    ]  # fmt: skip
    assert new_messages(recorded, echoed) == [echoed[2]]
    echoed[1]["tool_calls"][0]["function"]["arguments"] = '{"a": 9, "b": 2}'
    with pytest.raises(EpisodeConflict):
        new_messages(recorded, echoed)


def test_bad_input_is_refused_before_anything_is_recorded_and_a_corrected_retry_goes_on():
    """vLLM's own sampling checks (`stop: [""]`), `max_tokens` below 1 and a message past the budget are
    refused with their field (or the budget) before the episode records anything; it stays usable."""
    actor = StubActor(["hello", "ok", "fine"])  # budget: sampling.max_tokens = 200 response tokens
    gw = Gateway(actor)

    async def go() -> None:
        eid = (await gw.open_episode("p", group_size=1))["episode_id"]
        episode = gw._episodes[eid].episode
        first = [{"role": "user", "content": "hi"}]
        for extra, field in (
            ({"stop": [""]}, "stop"),
            ({"stop": ""}, "stop"),
            ({"max_tokens": -1}, "max_tokens"),
            ({"max_tokens": 0}, "max_tokens"),
            ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ):
            with pytest.raises(InvalidSampling) as e:
                await gw.chat(eid, body(first, **extra))
            assert e.value.field == field
            assert episode.prompt_ids == [] and episode.messages is None and not episode.ended
        r1 = await gw.chat(eid, body(first, stop=["\n"]))
        reply = r1["choices"][0]["message"]
        recorded = episode.tokens
        second = [*first, reply, {"role": "user", "content": "more"}]
        with pytest.raises(InvalidSampling, match="stop"):
            await gw.chat(eid, body(second, stop=[""]))
        with pytest.raises(BudgetExceeded) as past:
            await gw.chat(eid, body([*first, reply, {"role": "user", "content": "x" * 300}]))
        assert past.value.left == 200 - 5 and past.value.needed > 300
        assert episode.tokens == recorded and len(episode.messages or []) == 2 and not episode.ended
        r2 = await gw.chat(eid, body(second, max_tokens=2))  # the corrected retry extends the record
        assert r2["choices"][0]["message"]["content"] == "ok"
        assert (await gw.finish(eid, reward=1.0))["group_complete"]

    run(go())
    (group,) = actor.pushed
    (t,) = group.trajectories
    tok = actor.engine.tokenizer
    assert tok.decode(t.response_ids[t.policy_mask].tolist()) == "hellook"
    assert len(actor.engine.requests) == 2  # the refused calls never reached the engine


def test_an_episode_out_of_budget_refuses_further_calls():
    actor = StubActor(["a" * 200, "b"])
    gw = Gateway(actor)

    async def go() -> None:
        eid = (await gw.open_episode("p", group_size=1))["episode_id"]
        first = [{"role": "user", "content": "hi"}]
        r = await gw.chat(eid, body(first))
        assert r["usage"]["completion_tokens"] == 200
        with pytest.raises(BudgetExceeded) as e:
            await gw.chat(eid, body([*first, r["choices"][0]["message"], {"role": "user", "content": "?"}]))
        assert e.value.left == 0

    run(go())
