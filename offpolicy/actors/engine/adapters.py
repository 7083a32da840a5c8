"""The LoRA adapters one engine serves (`engine.lora`): the newest, which new requests carry, and the older
ones still used by requests in flight, each removed from the engine once no request uses it.

Every published version is registered under an id of its own (`lora_int_id` 1, 2, ... in load order) and a
name of its own (`v<version>-<id>`): a learner that rolled back re-publishes a version number with other
weights, and vLLM keys its adapter cache by id and its prefix cache by name and path (the same folder), so
neither may be reused for different weights. Before the first adapter (version 0 = the base model: B is
zero) requests carry none.

The engine holds at most `engine.lora.max_cpu_loras` adapters: vLLM's own cache evicts past it, and would
read an evicted adapter that requests still use again from its folder, which the learner may have pruned.
So before a new adapter would exceed it, the requests of the oldest superseded ones are aborted (`stale`):
their prompts are generated again, and their adapters go when those requests end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Adapter:
    """One registered adapter: its policy version, vLLM's `LoRARequest`, and the requests using it now."""

    version: int
    request: Any  # vllm.lora.request.LoRARequest
    users: set[str] = field(default_factory=set)  # request ids

    @property
    def lora_id(self) -> int:
        return int(self.request.lora_int_id)


class Adapters:
    """The bookkeeping of an engine's adapters (no vLLM call here: the engine makes them).

    `acquire(request_id)` at a request's submission returns the newest adapter (None before the first) and
    counts the request as its user; `release(adapter, request_id)` when the request has ended says whether
    the adapter is now unused and superseded (the engine removes it then). `add` makes a new adapter the
    newest and returns the older ones nobody uses (removed at once)."""

    def __init__(self) -> None:
        self.newest: Adapter | None = None
        self.held: dict[int, Adapter] = {}  # lora id -> adapter registered with the engine, in load order
        self._next_id = 1

    def next_id(self) -> int:
        """A `lora_int_id` never used before by this engine (vLLM wants ids > 0)."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def stale(self, capacity: int) -> list[Adapter]:
        """The oldest adapters to give up before one more is added (all held are superseded by it), so that
        the engine holds at most `capacity`: their requests are aborted, and each goes when they end."""
        return list(self.held.values())[: max(0, len(self.held) + 1 - capacity)]

    def add(self, version: int, request: Any) -> list[Adapter]:
        """`request` (registered with the engine) is the newest adapter, of `version`; the superseded ones
        that no request uses are returned (and forgotten): the engine removes them."""
        adapter = Adapter(version, request)
        self.held[adapter.lora_id] = adapter
        self.newest = adapter
        return [self._forget(a) for a in list(self.held.values()) if a is not adapter and not a.users]

    def acquire(self, request_id: str) -> Adapter | None:
        """The adapter request `request_id`, submitted now, carries (the newest; None before any)."""
        adapter = self.newest
        if adapter is not None:
            adapter.users.add(request_id)
        return adapter

    def release(self, adapter: Adapter, request_id: str) -> bool:
        """Request `request_id` using `adapter` ended: True when the adapter is superseded and unused now
        (forgotten: the engine removes it)."""
        adapter.users.discard(request_id)
        if not adapter.users and adapter is not self.newest and adapter.lora_id in self.held:
            self._forget(adapter)
            return True
        return False

    def _forget(self, adapter: Adapter) -> Adapter:
        del self.held[adapter.lora_id]
        return adapter

    def status(self) -> dict[str, Any]:
        """The newest adapter's version (None before any) and the versions held, in load order."""
        return {
            "adapter_version": None if self.newest is None else self.newest.version,
            "adapters_loaded": [a.version for a in self.held.values()],
        }
