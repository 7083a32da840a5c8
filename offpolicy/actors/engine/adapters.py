"""The LoRA adapters one engine serves (`engine.lora`), per run: each run's newest, which its new requests
carry, and its older ones still used by requests in flight, each removed from the engine once no request
uses it.

Every published version is registered under an id of its own (`lora_int_id` 1, 2, ... in load order, one
counter for the whole engine, whichever run it serves) and a name of its own (`v<version>-<id>`, or
`<run_id>-v<version>-<id>` for a pool's run): a learner that rolled back re-publishes a version number with
other weights, and vLLM keys its adapter cache by id and its prefix cache by name and path (the same
folder), so neither may be reused for different weights. Before a run's first adapter (its base version,
version 0 = the base model: B is zero) its requests carry none.

The engine holds at most `engine.lora.max_cpu_loras` adapters, all runs together: vLLM's own cache evicts
past it, and would read an evicted adapter that requests still use again from its folder, which the
learner may have pruned. So before a new adapter would exceed it, the requests of the oldest superseded
ones (any run's; never another run's newest) are aborted (`stale`): their prompts are generated again, and
their adapters go when those requests end. A pool gives each run room for two (its newest, and the one it
supersedes while its requests finish): `runs x 2 <= max_cpu_loras`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Adapter:
    """One registered adapter: its policy version, vLLM's `LoRARequest` (its `lora_path` is the engine's
    copy), the published folder it came from, and the requests using it now."""

    version: int
    request: Any  # vllm.lora.request.LoRARequest
    source: str = ""  # the published folder (the engine registers a copy of it)
    users: set[str] = field(default_factory=set)  # request ids

    @property
    def lora_id(self) -> int:
        return int(self.request.lora_int_id)


class Adapters:
    """One run's adapters on an engine (no vLLM call here: the engine makes them).

    `acquire(request_id)` at a request's submission returns the newest adapter (None before the first) and
    counts the request as its user; `release(adapter, request_id)` when the request has ended says whether
    the adapter is now unused and superseded (the engine removes it then). `add` makes a new adapter the
    newest and returns the older ones nobody uses (removed at once). `run_id` None: the engine's own (an
    actor that built its engine); `base_version`: the version its requests carry before its first adapter."""

    def __init__(self, run_id: str | None = None, base_version: int = 0) -> None:
        self.run_id, self.base_version = run_id, base_version
        self.newest: Adapter | None = None
        self.held: dict[int, Adapter] = {}  # lora id -> adapter registered with the engine, in load order

    @property
    def version(self) -> int:
        """The version new requests carry: the newest adapter's, or the base's before any."""
        return self.base_version if self.newest is None else self.newest.version

    def name(self, version: int, lora_id: int) -> str:
        """The adapter's name in the engine (unique: the id is)."""
        return f"v{version}-{lora_id}" if self.run_id is None else f"{self.run_id}-v{version}-{lora_id}"

    def add(self, version: int, request: Any, source: str = "") -> list[Adapter]:
        """`request` (registered with the engine, from published folder `source`) is the newest adapter, of
        `version`; the superseded ones that no request uses are returned (and forgotten): the engine
        removes them."""
        adapter = Adapter(version, request, source)
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


class AdapterTable:
    """Every run's adapters on one engine: one id counter, one capacity (`max_cpu_loras`). Used on the
    engine's event loop only (requests acquire and release there)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.runs: dict[str | None, Adapters] = {}  # run id (None: the engine's own) -> its adapters
        self._ids = itertools.count(1)

    def add_run(self, run_id: str | None, base_version: int = 0) -> Adapters:
        """A new run's (empty) adapters; `ValueError` for a run id already served."""
        if run_id in self.runs:
            raise ValueError(f"run {run_id!r} is already served by this engine")
        adapters = self.runs[run_id] = Adapters(run_id, base_version)
        return adapters

    def drop_run(self, run_id: str | None) -> list[Adapter]:
        """Forget a run; every adapter it held (the engine aborts their requests and removes them: their
        ends release nothing more)."""
        adapters = self.runs.pop(run_id)
        held, adapters.held, adapters.newest = list(adapters.held.values()), {}, None
        return held

    def next_id(self) -> int:
        """A `lora_int_id` never used before by this engine (vLLM wants ids > 0)."""
        return next(self._ids)

    @property
    def held(self) -> int:
        """Adapters registered with the engine now, all runs together."""
        return sum(len(a.held) for a in self.runs.values())

    def stale(self, adding: Adapters) -> list[Adapter]:
        """The oldest adapters to give up before `adding` gets one more, so that the engine holds at most
        `capacity`: any run's superseded ones and `adding`'s newest (superseded by the new one), never
        another run's newest. Their requests are aborted, and each goes when they end."""
        givable = [
            a for run in self.runs.values() for a in run.held.values() if run is adding or a is not run.newest
        ]
        givable.sort(key=lambda a: a.lora_id)  # the engine-wide load order
        return givable[: max(0, self.held + 1 - self.capacity)]
