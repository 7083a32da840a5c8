"""What the actor service's pool uses of an engine, without vLLM (hermetic tests of the actor app): an engine
of full weights (one run) or one serving LoRA adapters (each run a view of its own)."""

from __future__ import annotations

from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any


class StubEngine:
    """`kind`, `base_loads`, `alive`, `call`, `acall`, `add_run`, `drop_run`, `shutdown`: what the pool and
    the service call. `add_run` gives a view that carries the run id; every call is recorded."""

    def __init__(self, kind: str = "full") -> None:
        self.kind, self.base_loads, self.alive = kind, 0, True
        self.added: list[str] = []
        self.dropped: list[str] = []
        self.views: dict[str, SimpleNamespace] = {}
        self.shut = False

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Its coroutines never wait: run one to its end here (the real engine runs it on its loop)."""
        try:
            coro.send(None)
        except StopIteration as done:
            return done.value
        raise AssertionError("a stub engine's coroutine waited")

    async def acall(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await coro

    async def add_run(self, run_id: str, base_version: int = 0) -> Any:
        self.added.append(run_id)
        self.views[run_id] = SimpleNamespace(
            run_id=run_id, kind="lora", base_version=base_version, dropped=False
        )
        return self.views[run_id]

    async def drop_run(self, run_id: str) -> None:
        """The run's adapters leave the engine: its view serves nothing more (`dropped`)."""
        self.dropped.append(run_id)
        if run_id in self.views:
            self.views[run_id].dropped = True

    def shutdown(self) -> None:
        self.shut = True
