"""The engine's weights through vLLM's weight-transfer engine (actors/transport/): join and leave a transfer
group, receive a version into the paused engine. Functions of a `VLLMEngine` (engine/vllm.py, whose methods
of the same names call them): they use its `llm` (vLLM's `AsyncLLM`) and `acall`, and set its
`loaded_version`, `loaded_path`, `base_loads` and `broken`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from offpolicy.actors.errors import EngineError, WeightLoadError

STALL_GRACE_S = 5.0
"""Seconds past a transfer's `timeout_s` after which a receive that has not returned counts as stalled."""


async def join_transfer(engine: Any, init_info: dict[str, Any], timeout_s: float) -> None:
    """Join a transfer group (`init_weight_transfer_engine` on every worker), waiting at most
    `timeout_s`; raises `WeightLoadError` (`transfer`)."""
    try:
        await engine.acall(
            engine.llm.collective_rpc(
                "init_weight_transfer_engine", timeout=timeout_s, kwargs={"init_info": init_info}
            )
        )
    except Exception as e:  # translated: the rendezvous fails in many ways (timeout, refused, shape)
        raise WeightLoadError(engine.loaded_version, "transfer", f"join: {type(e).__name__}: {e}") from e


async def discard_partial_loads(engine: Any, timeout_s: float | None = None) -> None:
    """After a failed receive, before loading a file generation: the workers drop what the receive had
    buffered for modules it had not filled (weights/engines/worker_ext.py)."""
    await engine.acall(engine.llm.collective_rpc("offpolicy_discard_partial_loads", timeout=timeout_s))


async def leave_transfer(engine: Any) -> None:
    """Drop the transfer group (the engine keeps serving)."""
    with contextlib.suppress(Exception):  # a broken group may not shut down cleanly; it is gone anyway
        await engine.acall(engine.llm.collective_rpc("shutdown_weight_transfer_engine", timeout=30))


async def receive_weights(engine: Any, update_info: Any, version: int, timeout_s: float) -> None:
    """Receive `version` from the transfer group into the engine; then `loaded_version = version`.

    Call it inside `paused()`. vLLM's three calls (`start_weight_update`, `update_weights`, which
    receives, and `finish_weight_update`, which tags the version on the tokens sampled from now on),
    then the prefix cache is reset as after a file load. Raises `WeightLoadError` (`transfer`): the
    engine may then hold partly received weights, and the caller loads a file generation back.
    `EngineError` when the calls have not returned `STALL_GRACE_S` after `timeout_s`: the engine is
    blocked in the receive, marked broken, and the actor must end (its restart loads from files).
    """
    rpc = engine.llm.collective_rpc
    bound = timeout_s + STALL_GRACE_S
    stall = asyncio.timeout(bound)
    try:
        # vLLM's one-process executor (TP=1) ignores collective_rpc's timeout: a receive stalled in a
        # collective would hold this engine paused for good, so the wait is bounded here too
        async with stall:
            await engine.acall(rpc("start_weight_update", timeout=timeout_s))
            await engine.acall(rpc("update_weights", timeout=timeout_s, kwargs={"update_info": update_info}))
            await engine.acall(rpc("finish_weight_update", timeout=timeout_s))
    except Exception as e:  # translated: a dead peer, a timeout, or a shape/dtype mismatch
        if not stall.expired():
            raise WeightLoadError(version, "transfer", f"{type(e).__name__}: {e}") from e
        # the engine's worker is blocked in the receive: it cannot be reused
        engine.broken = (
            f"the transfer of v{version} stalled for {bound:g} s inside the engine (a blocked collective "
            "that vLLM's executor does not time out): the actor exits, and its restart loads the newest "
            "file generation"
        )
        raise EngineError(engine.broken) from e
    await engine.acall(engine.llm.update_weight_version(str(version)))
    await engine.after_load(version)
    engine.loaded_version = version
    engine.loaded_path = ""  # no folder holds exactly these weights (a restore must read a generation)
    engine.base_loads += 1
