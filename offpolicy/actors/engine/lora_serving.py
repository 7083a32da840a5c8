"""The vLLM engine's LoRA serving (`engine.lora`): registering a run's new adapter while it generates,
each run's adapters (a pool's runs), and removing superseded ones; mixed into `VLLMEngine` (engine/vllm.py),
whose docstring says how requests carry their adapter and how their tokens are stamped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from offpolicy.actors.engine.adapters import Adapter, Adapters, AdapterTable
from offpolicy.actors.engine.run_view import RunView
from offpolicy.actors.errors import RunNotFound, WeightLoadError

log = logging.getLogger(__name__)


class LoraServing:
    """`VLLMEngine`'s LoRA methods. The engine sets `adapter_table` (None: full weights), `adapters` (its
    own run's), `llm`, `_loop`, `loaded_version` and `loaded_path`, and provides `acall` and `abort`."""

    adapter_table: AdapterTable | None
    adapters: Adapters | None
    llm: Any
    _loop: asyncio.AbstractEventLoop
    loaded_version: int
    loaded_path: str
    acall: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]]
    abort: Callable[[Sequence[str]], Awaitable[None]]

    async def load_adapter(
        self, path: str, version: int, timeout_s: float | None = None, run_id: str | None = None
    ) -> None:
        """Register the LoRA adapter in folder `path` (peft's layout) as `version` of run `run_id` (None:
        the engine's own) while the engine generates; that run's requests submitted from now on carry it
        (the engine's own: `loaded_version = version`). Superseded adapters no request uses are removed;
        past `engine.lora.max_cpu_loras` adapters (all runs), the requests of the oldest superseded ones
        are aborted first (their prompts are generated again). Raises `WeightLoadError` (`timeout`, or
        `engine`: vLLM refused the adapter, e.g. a rank above `engine.lora.max_rank`); the engine then
        serves what it did."""
        from vllm.lora.request import LoRARequest

        if self.adapter_table is None:
            raise WeightLoadError(version, "kind", "this engine serves full weights (engine.lora is unset)")
        adapters = self.adapters_of(run_id)
        assert adapters is not None
        if stale := self.adapter_table.stale(adapters):
            log.warning(
                "v%d: the engine holds %d adapters (engine.lora.max_cpu_loras): aborting the requests of "
                "%s, generated again", version, self.adapter_table.held,
                ", ".join(a.request.lora_name for a in stale),
            )  # fmt: skip
            await self.abort(sorted({rid for a in stale for rid in a.users}))
        lora_id = self.adapter_table.next_id()
        request = LoRARequest(lora_name=adapters.name(version, lora_id), lora_int_id=lora_id, lora_path=path)
        try:
            async with asyncio.timeout(timeout_s):
                added = await self.acall(self.llm.add_lora(request))
        except TimeoutError as e:
            self._spawn(self._remove(lora_id))  # in case vLLM registers it after all
            raise WeightLoadError(version, "timeout", f"no answer from the engine in {timeout_s} s") from e
        except asyncio.CancelledError:  # the run stops: the adapter may be registered all the same
            self._spawn(self._remove(lora_id))
            raise
        except Exception as e:  # translated: vLLM refuses adapters in many ways (files, rank, modules)
            raise WeightLoadError(version, "engine", f"{type(e).__name__}: {e}") from e
        if not added:
            raise WeightLoadError(version, "engine", f"vLLM did not register adapter {request.lora_name}")
        for old in adapters.add(version, request):
            self._retire(old)
        if run_id is None:
            self.loaded_version, self.loaded_path = version, path

    def adapters_of(self, run_id: str | None) -> Adapters | None:
        """The adapters of run `run_id` (None: the engine's own); None for an engine of full weights.
        `RunNotFound` for a run the engine does not serve (never added, or dropped)."""
        if self.adapter_table is None:
            return None
        if run_id not in self.adapter_table.runs:
            raise RunNotFound(f"this engine serves no run {run_id!r}")
        return self.adapter_table.runs[run_id]

    async def add_run(self, run_id: str, base_version: int = 0) -> RunView:
        """Serve one more run on this engine's base model (a pool's): its own adapters, its requests
        carrying its newest (`RunView`); `base_version` is what they carry before its first. Call it on the
        engine's loop (`engine.call(engine.add_run(...))`). `ValueError` for an engine of full weights or
        a run id already served; the pool checks the capacity before (`runs x 2 <= max_cpu_loras`)."""
        if self.adapter_table is None:
            raise ValueError("an engine of full weights serves one run (set engine.lora for several)")
        return RunView(self, self.adapter_table.add_run(run_id, base_version))

    async def drop_run(self, run_id: str) -> None:
        """Stop serving run `run_id`: the requests on its adapters are aborted and its adapters removed
        from the engine (its actor has stopped: nothing of it runs any more)."""
        assert self.adapter_table is not None
        held = self.adapter_table.drop_run(run_id)
        await self.abort(sorted({rid for a in held for rid in a.users}))
        for adapter in held:
            await self._remove(adapter.lora_id)

    def _retire(self, adapter: Adapter) -> None:
        """Remove a superseded adapter that no request uses from the engine (in the background)."""
        self._spawn(self._remove(adapter.lora_id))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` on the engine's loop without waiting for it (its failure is logged by itself)."""
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _remove(self, lora_id: int) -> None:
        try:
            await self.llm.remove_lora(lora_id)
        except Exception as e:  # translated: an engine shutting down takes its adapters with it
            log.warning("LoRA adapter %d not removed from the engine: %s: %s", lora_id, type(e).__name__, e)
