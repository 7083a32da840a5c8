"""A receive that never returns (vLLM's one-process executor, TP=1, ignores collective_rpc's timeout): the
engine bounds the wait itself, marks itself broken and raises `EngineError`, which ends the actor (its
restart loads the newest file generation); a receive that fails in time stays a `WeightLoadError`."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from offpolicy.actors.engine import vllm
from offpolicy.actors.errors import EngineError, WeightLoadError


def engine_with(rpc) -> vllm.VLLMEngine:
    """A `VLLMEngine` around a stand-in for vLLM's `AsyncLLM` (only `collective_rpc`), on its own loop."""
    engine = vllm.VLLMEngine.__new__(vllm.VLLMEngine)
    engine._loop = asyncio.new_event_loop()
    threading.Thread(target=engine._loop.run_forever, daemon=True).start()
    engine.llm = SimpleNamespace(collective_rpc=rpc)
    engine.broken, engine.loaded_version = None, 0
    return engine


def test_a_stalled_receive_ends_within_the_bound_and_marks_the_engine_broken():
    async def never(*_args, **_kwargs):
        await asyncio.sleep(3600)  # the engine core blocked in a collective that does not time out

    engine = engine_with(never)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="stalled"):
        asyncio.run(engine.receive_weights({}, 7, timeout_s=0.5))
    took = time.monotonic() - t0
    assert 0.5 + vllm.STALL_GRACE_S - 0.1 <= took <= 0.5 + vllm.STALL_GRACE_S + 2
    assert engine.broken is not None and "v7" in engine.broken and engine.loaded_version == 0


def test_a_receive_that_fails_in_time_is_a_weight_load_error():
    async def fails(*_args, **_kwargs):
        raise TimeoutError("RPC call to update_weights timed out.")  # the multi-process executor's own

    engine = engine_with(fails)
    with pytest.raises(WeightLoadError, match="transfer"):
        asyncio.run(engine.receive_weights({}, 7, timeout_s=0.5))
    assert engine.broken is None  # the receiver recovers from files and the engine resumes
