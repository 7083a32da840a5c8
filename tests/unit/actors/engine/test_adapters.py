"""The engine's LoRA adapters (`engine.lora`) on a stand-in for vLLM's `AsyncLLM` (hermetic): each request
carries the newest adapter at its submission and keeps it, its tokens carry that adapter's version, a new
version never pauses the engine, and a superseded adapter is removed once no request uses it (and the
engine's copy of its folder with it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from offpolicy.actors.config import EngineConfig, LoraEngineConfig
from offpolicy.actors.engine import vllm
from offpolicy.actors.engine.lora_serving import LoraServing
from offpolicy.actors.errors import WeightLoadError
from tests.unit.actors.engine.conftest import source

pytestmark = pytest.mark.usefixtures("stand_in_adapter_files")


class StandInLLM:
    """`generate` holds each request until the test releases it; `add_lora` / `remove_lora` are recorded."""

    def __init__(self) -> None:
        self.carried: dict[str, object] = {}  # request id -> its LoRARequest (None = the base)
        self.release: dict[str, asyncio.Event] = {}
        self.added: list[object] = []
        self.removed: list[int] = []
        self.aborted: list[str] = []
        self.refuse: Exception | None = None

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.carried[request_id] = lora_request
        await self.release.setdefault(request_id, asyncio.Event()).wait()
        ids = [4, 5, 6]
        flat = SimpleNamespace(token_ids=ids, logprobs=[-1.0] * 3)
        span = [SimpleNamespace(version="0", start=0, end=3)]  # vLLM's label stays at the base's
        finish = "abort" if request_id in self.aborted else "length"
        out = SimpleNamespace(
            token_ids=ids, logprobs=flat, finish_reason=finish, text="abc", weight_versions=span
        )
        yield SimpleNamespace(outputs=[out, out])

    async def add_lora(self, request) -> bool:
        if self.refuse is not None:
            raise self.refuse
        self.added.append(request)
        return True

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for rid in request_ids:
            self.release.setdefault(rid, asyncio.Event()).set()

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


def lora_engine(max_cpu_loras: int = 4) -> tuple[vllm.VLLMEngine, StandInLLM]:
    """A `VLLMEngine` serving adapters around the stand-in, on the running loop (call inside it)."""
    engine = vllm.VLLMEngine.__new__(vllm.VLLMEngine)
    engine.config = EngineConfig(lora=LoraEngineConfig(max_loras=1, max_cpu_loras=max_cpu_loras))
    engine._loop = asyncio.get_running_loop()
    engine.llm = llm = StandInLLM()
    engine.lora = LoraServing(
        llm, max_cpu_loras, 0, acall=engine.acall, abort=engine.abort, loop=engine._loop
    )
    engine.kind, engine.loaded_version, engine.loaded_path = "lora", 0, "/base"
    engine.base_loads, engine.tokenizer = 0, None
    return engine, llm


async def settle() -> None:
    for _ in range(5):  # removals run as their own tasks on the loop
        await asyncio.sleep(0)


def test_requests_keep_the_adapter_they_started_with_and_old_ones_go_once_unused():
    async def scenario():
        engine, llm = lora_engine()

        def submit(rid: str) -> asyncio.Task:
            return asyncio.create_task(engine._generate(rid, [1, 2], None))

        base = submit("r0")  # before any adapter: the base model (version 0), no LoRARequest
        await settle()
        assert llm.carried["r0"] is None
        await engine.load_adapter("/w/v1", 1)
        first = submit("r1")
        await settle()
        assert llm.carried["r1"].lora_int_id == 1 and source(llm.carried["r1"]) == "/w/v1"
        assert Path(llm.carried["r1"].lora_path).parent == engine.lora.files  # the engine's own copy
        await engine.load_adapter("/w/v2", 2)  # r1 still runs on v1: v1 stays
        second = submit("r2")
        await settle()
        assert llm.carried["r2"].lora_int_id == 2 and llm.removed == []
        assert engine.loaded_version == 2 and engine.adapters.status()["adapters_loaded"] == [1, 2]
        for rid in ("r0", "r1", "r2"):
            llm.release.setdefault(rid, asyncio.Event()).set()
        done = [await t for t in (base, first, second)]
        assert [c.versions.tolist() for c in done[0]] == [[0, 0, 0]] * 2
        assert [c.versions.tolist() for c in done[1]] == [[1, 1, 1]] * 2  # the request's adapter, all through
        assert [c.versions.tolist() for c in done[2]] == [[2, 2, 2]] * 2
        await settle()
        assert llm.removed == [1], "v1 goes once its last request ended; v2, the newest, stays"
        assert sorted(p.name for p in engine.lora.files.iterdir()) == ["2"], "v1's copy goes with it"
        await engine.load_adapter("/w/v3", 3)  # nobody uses v2: removed at once
        await settle()
        assert llm.removed == [1, 2]
        assert engine.adapters.status() == {"adapter_version": 3, "adapters_loaded": [3]}
        assert engine.base_loads == 0 and [r.lora_int_id for r in llm.added] == [1, 2, 3]
        assert len({r.lora_name for r in llm.added}) == 3  # a name per adapter: vLLM's caches key on it

    asyncio.run(scenario())


def test_a_republished_version_is_a_new_adapter():
    """A learner that rolled back re-publishes a version number with other weights: new id, new name."""

    async def scenario():
        engine, llm = lora_engine()
        await engine.load_adapter("/w/v5", 5)
        await engine.load_adapter("/w/v6", 6)
        await engine.load_adapter("/w/v5", 5)
        ids = [(r.lora_int_id, r.lora_name) for r in llm.added]
        assert len(set(ids)) == 3 and engine.loaded_version == 5

    asyncio.run(scenario())


def test_a_refused_adapter_leaves_the_engine_as_it_was():
    async def scenario():
        engine, llm = lora_engine()
        await engine.load_adapter("/w/v1", 1)
        llm.refuse = ValueError("LoRA rank 64 is greater than max_lora_rank 16.")
        with pytest.raises(WeightLoadError, match="max_lora_rank") as e:
            await engine.load_adapter("/w/v2", 2)
        assert e.value.reason == "engine" and engine.loaded_version == 1
        assert engine.adapters.newest.version == 1 and llm.removed == []

    asyncio.run(scenario())


def test_an_engine_without_lora_refuses_an_adapter():
    async def scenario():
        engine, _ = lora_engine()
        engine.lora, engine.kind = None, "full"
        with pytest.raises(WeightLoadError) as e:
            await engine.load_adapter("/w/v1", 1)
        assert e.value.reason == "kind"

    asyncio.run(scenario())


def test_past_max_cpu_loras_the_oldest_adapters_requests_are_aborted_first():
    """vLLM would evict an adapter past `max_cpu_loras` and read it again from a folder the learner may
    have pruned: the engine never holds more; the oldest superseded adapter's requests are aborted (their
    prompts are generated again) and it goes when they have ended."""

    async def scenario():
        engine, llm = lora_engine(max_cpu_loras=2)
        await engine.load_adapter("/w/v1", 1)
        first = asyncio.create_task(engine._generate("r1", [1], None))
        await settle()
        await engine.load_adapter("/w/v2", 2)
        second = asyncio.create_task(engine._generate("r2", [1], None))
        await settle()
        assert llm.aborted == [] and engine.adapters.status()["adapters_loaded"] == [1, 2]
        await engine.load_adapter("/w/v3", 3)  # a third would be one too many: v1's request goes
        assert llm.aborted == ["r1"]
        assert [c.finish_reason for c in await first] == ["abort"] * 2
        await settle()
        assert llm.removed == [1] and engine.adapters.status()["adapters_loaded"] == [2, 3]
        llm.release["r2"].set()
        assert [c.versions.tolist() for c in await second] == [[2, 2, 2]] * 2
        await settle()
        assert llm.removed == [1, 2] and engine.adapters.status()["adapters_loaded"] == [3]

    asyncio.run(scenario())


def test_with_room_for_one_adapter_the_newest_ones_requests_make_way():
    async def scenario():
        engine, llm = lora_engine(max_cpu_loras=1)
        await engine.load_adapter("/w/v1", 1)
        first = asyncio.create_task(engine._generate("r1", [1], None))
        await settle()
        await engine.load_adapter("/w/v2", 2)
        assert llm.aborted == ["r1"] and [c.finish_reason for c in await first] == ["abort"] * 2
        await settle()
        assert llm.removed == [1] and engine.adapters.status()["adapters_loaded"] == [2]

    asyncio.run(scenario())
