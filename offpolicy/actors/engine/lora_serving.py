"""The vLLM engine's LoRA serving (`engine.lora`): `LoraServing` owns every run's adapters on one engine
(`AdapterTable`) and registers a run's new adapter while the engine generates, and removes superseded ones;
`VLLMEngine` (engine/vllm.py) builds one with what it uses (vLLM's `AsyncLLM`, the engine's `acall`,
`abort` and loop) and delegates to it. The engine's docstring says how requests carry their adapter and
how their tokens are stamped.

vLLM reads an adapter's folder again whenever a request needs it and it is not in vLLM's cache (evicted
past `max_cpu_loras`, as when a removal is still on its way): the folder it is given must outlive the
adapter. The learner prunes its version folders on its own schedule (`publish.keep_versions`), so each
adapter is registered from the engine's own copy (`hold_files`: hard links where the filesystem allows,
else a copy), deleted once the adapter is removed from the engine."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from offpolicy.actors.engine.adapters import Adapter, Adapters, AdapterTable
from offpolicy.actors.errors import RunNotFound, WeightLoadError

log = logging.getLogger(__name__)


def hold_files(src: str | Path, dest: Path) -> None:
    """Make `dest` (new) an adapter folder with `src`'s files that only its owner deletes: hard links where
    both share a filesystem (no bytes written; deleting `src` leaves them), copies elsewhere. `OSError`
    (`src` gone, a full disk) with `dest` removed."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"no adapter folder {src}")
    try:
        dest.mkdir(parents=True)
        for p in sorted(src.rglob("*")):
            target = dest / p.relative_to(src)
            if p.is_dir():
                target.mkdir(exist_ok=True)
                continue
            try:
                os.link(p, target)
            except OSError:  # another filesystem (EXDEV), or links not allowed: a copy
                shutil.copy2(p, target)
    except OSError:
        shutil.rmtree(dest, ignore_errors=True)
        raise


class LoraServing:
    """The adapters of one engine serving LoRA: `adapter_table` (every run's), `adapters` (the engine's own
    run's: the actor that built it). Given when built: `llm` (vLLM's `AsyncLLM`: `add_lora`,
    `remove_lora`), `capacity` (`engine.lora.max_cpu_loras`), `initial_version` (the engine's own run's
    base version), `acall` (awaits a coroutine on the engine's loop), `abort` (aborts requests by id),
    `loop` (the engine's loop, where removals run in the background) and `files_dir` (where the engine's
    copies of its adapters go, in a folder of this engine's own; None: the system's temporary folder).
    Used on that loop, as the table is."""

    def __init__(
        self,
        llm: Any,
        capacity: int,
        initial_version: int,
        *,
        acall: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]],
        abort: Callable[[Sequence[str]], Awaitable[None]],
        loop: asyncio.AbstractEventLoop,
        files_dir: str | None = None,
    ) -> None:
        self.llm: Any = llm
        self.adapter_table = AdapterTable(capacity)
        self.adapters = self.adapter_table.add_run(None, initial_version)
        self._acall, self._abort, self._loop = acall, abort, loop
        if files_dir is not None:
            Path(files_dir).mkdir(parents=True, exist_ok=True)
        self.files = Path(tempfile.mkdtemp(prefix="offpolicy-lora-", dir=files_dir))
        """The engine's copies of the adapters it holds: `<files>/<lora id>/`."""

    async def load_adapter(
        self, path: str, version: int, timeout_s: float | None = None, run_id: str | None = None
    ) -> None:
        """Register the LoRA adapter in folder `path` (peft's layout) as `version` of run `run_id` (None:
        the engine's own) while the engine generates; that run's requests submitted from now on carry it.
        The engine registers its own copy of the folder (`hold_files`), so that `path` may go at any time.
        Superseded adapters no request uses are removed; past `capacity` adapters (all runs), the requests
        of the oldest superseded ones are aborted first (their prompts are generated again). Raises
        `WeightLoadError` (`timeout`; `missing`: the folder could not be copied, e.g. pruned before; or
        `engine`: vLLM refused the adapter, e.g. a rank above `engine.lora.max_rank`); the engine then
        serves what it did. `RunNotFound` for a run not served."""
        from vllm.lora.request import LoRARequest

        adapters = self.adapters_of(run_id)
        if stale := self.adapter_table.stale(adapters):
            log.warning(
                "v%d: the engine holds %d adapters (engine.lora.max_cpu_loras): aborting the requests of "
                "%s, generated again", version, self.adapter_table.held,
                ", ".join(a.request.lora_name for a in stale),
            )  # fmt: skip
            await self._abort(sorted({rid for a in stale for rid in a.users}))
        lora_id = self.adapter_table.next_id()
        held = self.files / str(lora_id)
        try:
            await asyncio.to_thread(hold_files, path, held)
        except OSError as e:
            raise WeightLoadError(version, "missing", f"{path}: {type(e).__name__}: {e}") from e
        request = LoRARequest(
            lora_name=adapters.name(version, lora_id), lora_int_id=lora_id, lora_path=str(held)
        )
        try:
            async with asyncio.timeout(timeout_s):
                added = await self._acall(self.llm.add_lora(request))
        except TimeoutError as e:
            self._spawn(self._remove(lora_id))  # in case vLLM registers it after all
            raise WeightLoadError(version, "timeout", f"no answer from the engine in {timeout_s} s") from e
        except asyncio.CancelledError:  # the run stops: the adapter may be registered all the same
            self._spawn(self._remove(lora_id))
            raise
        except Exception as e:  # translated: vLLM refuses adapters in many ways (files, rank, modules)
            shutil.rmtree(held, ignore_errors=True)
            raise WeightLoadError(version, "engine", f"{type(e).__name__}: {e}") from e
        if not added:
            shutil.rmtree(held, ignore_errors=True)
            raise WeightLoadError(version, "engine", f"vLLM did not register adapter {request.lora_name}")
        for old in adapters.add(version, request, str(path)):
            self._retire(old)

    def adapters_of(self, run_id: str | None) -> Adapters:
        """The adapters of run `run_id` (None: the engine's own). `RunNotFound` for a run the engine does
        not serve (never added, or dropped)."""
        if run_id not in self.adapter_table.runs:
            raise RunNotFound(f"this engine serves no run {run_id!r}")
        return self.adapter_table.runs[run_id]

    def release(self, adapters: Adapters, adapter: Adapter, request_id: str) -> None:
        """Request `request_id` of the run of `adapters`, which carried `adapter`, has ended: the adapter is
        removed from the engine (in the background) if it is now superseded and unused."""
        if adapters.release(adapter, request_id):
            self._retire(adapter)

    def add_run(self, run_id: str, base_version: int = 0) -> Adapters:
        """One more run's (empty) adapters; `base_version` is what its requests carry before its first.
        `ValueError` for a run id already served."""
        return self.adapter_table.add_run(run_id, base_version)

    async def drop_run(self, run_id: str) -> None:
        """Stop serving run `run_id`: the requests on its adapters are aborted and its adapters removed
        from the engine. Call it on the engine's loop."""
        held = self.adapter_table.drop_run(run_id)
        await self._abort(sorted({rid for a in held for rid in a.users}))
        for adapter in held:
            await self._remove(adapter.lora_id)

    def close(self) -> None:
        """Forget `llm` (the engine shuts down: vLLM's `AsyncLLM` must go with its last reference) and delete
        the engine's copies of its adapters."""
        self.llm = None
        shutil.rmtree(self.files, ignore_errors=True)

    def _retire(self, adapter: Adapter) -> None:
        """Remove a superseded adapter that no request uses from the engine (in the background)."""
        self._spawn(self._remove(adapter.lora_id))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` on the engine's loop without waiting for it (its failure is logged by itself)."""
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _remove(self, lora_id: int) -> None:
        """Remove adapter `lora_id` from the engine, then its files (vLLM reads them no more)."""
        try:
            await self.llm.remove_lora(lora_id)
        except Exception as e:  # translated: an engine shutting down takes its adapters with it
            log.warning("LoRA adapter %d not removed from the engine: %s: %s", lora_id, type(e).__name__, e)
        shutil.rmtree(self.files / str(lora_id), ignore_errors=True)
