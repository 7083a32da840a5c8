"""One run's view of a pool's shared engine: its own adapters and versions; the rest is the engine's."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from offpolicy.actors.config import SamplingConfig
    from offpolicy.actors.engine.adapters import Adapters

T = TypeVar("T")


class RunView:
    """What one run's actor (its loop, weight sync, gateway, evaluation) sees of a pool's engine serving
    LoRA adapters (`VLLMEngine.add_run`): the engine's interface, with `adapters`, `loaded_version` and
    `loaded_path` of this run alone; its requests carry this run's newest adapter and its new versions are
    registered as this run's. The actor code is the same as on an engine of its own."""

    kind = "lora"

    def __init__(self, engine: Any, adapters: Adapters) -> None:  # a VLLMEngine (which imports this)
        assert adapters.run_id is not None
        self.engine, self.adapters, self.run_id = engine, adapters, adapters.run_id
        self.config, self.tokenizer = engine.config, engine.tokenizer

    @property
    def loaded_version(self) -> int:
        """This run's newest adapter's version (what its new requests carry), or its base version."""
        return self.adapters.version

    @property
    def loaded_path(self) -> str:
        """This run's newest adapter's published folder, or the base model's before any."""
        newest = self.adapters.newest
        return self.engine.loaded_path if newest is None else newest.source

    @property
    def base_loads(self) -> int:
        return self.engine.base_loads

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.engine.call(coro, timeout_s)

    async def acall(self, coro: Coroutine[Any, Any, T]) -> T:
        return await self.engine.acall(coro)

    def sampling_params(self, sampling: SamplingConfig, n: int | None = None, **overrides: Any) -> Any:
        return self.engine.sampling_params(sampling, n, **overrides)

    @property
    def return_routed_experts(self) -> bool:
        return self.engine.return_routed_experts

    async def generate_group(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: Any,
        routed_start: int | None = None,
        images: Sequence[Any] | None = None,
    ) -> list[Any]:
        """One request of this run: it carries the run's newest adapter, its tokens that version."""
        return await self.engine.generate_group(
            request_id, prompt_ids, params, run_id=self.run_id, routed_start=routed_start, images=images
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.engine.abort(request_ids)

    async def load_adapter(self, path: str, version: int, timeout_s: float | None = None) -> None:
        """Register `version` of this run (`VLLMEngine.load_adapter`)."""
        await self.engine.load_adapter(path, version, timeout_s, run_id=self.run_id)
