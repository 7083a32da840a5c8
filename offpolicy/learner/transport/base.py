"""The transport interface: the learner sends a version; both sides report the version and the time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What one send did: `ok` when every member of the group confirmed the version."""

    version: int
    seconds: float
    bytes: int = 0
    group_size: int = 0  # receiving actors (the learner's rank is not counted)
    ok: bool = True
    error: str = ""
    dropped: tuple[str, ...] = ()  # members found dead during the send (their heartbeats stopped): left out
    dead_wait_s: float = 0.0  # seconds the send spent on dead members (finding them, sending again)
    full_bytes: int = 0  # a delta round (`publish.delta`): the bytes of the version whole; 0 = sent whole


class WeightTransport(Protocol):
    """Sends the learner's current weights as `version` to the actors."""

    name: str
    stuck: int  # sends and teardowns that outlived their bound (a hung rendezvous, collective or sync)

    @property
    def busy(self) -> bool: ...  # a send or teardown past its bound still unwinds: sends fail at once

    def send(self, version: int) -> TransferResult: ...

    def close(self) -> None: ...
