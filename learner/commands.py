"""The leader's side of the step-boundary commands of a learner on N ranks (learner/distributed.py).

What the next `Command` carries besides the step's groups: the config the leader applied since the last
command, and a checkpoint another thread asked for (`POST /v1/checkpoints`), which that thread waits on
until the loop has taken it at a boundary (every rank checkpoints its shards) and it is durable.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from learner.distributed import Command, Ranks, broadcast_command
from learner.errors import WriteFailed

if TYPE_CHECKING:
    from learner.config import LearnerConfig


class LeaderChannel:
    """Rank 0's commands to the other ranks; `request_checkpoint` is the only method of another thread."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.stopped = False  # the followers were sent `stop`
        self._unsent: tuple[LearnerConfig, int] | None = None  # applied here, not yet sent
        self._asked = threading.Event()
        self._done = threading.Condition()
        self._taken = 0  # checkpoints taken on request
        self._last: tuple[Path, int] | None = None

    def config_applied(self, config: LearnerConfig, version: int) -> None:
        """The next command carries `config` to every rank."""
        self._unsent = (config, version)

    def send(self, op: str, frames: list[bytes]) -> Command:
        """Broadcast this boundary's command: `op`, the groups' frames, the unsent config, a request."""
        with self._done:  # read and cleared together: a request set in between is never lost
            ask = self._asked.is_set()
            self._asked.clear()
        change, self._unsent = self._unsent, None
        cfg_json, cfg_version = (change[0].model_dump_json(), change[1]) if change else (None, 0)
        return broadcast_command(self.ranks, Command(op, frames, cfg_json, cfg_version, checkpoint=ask))

    def request_checkpoint(self) -> tuple[Path, int]:
        """Another thread: have the loop checkpoint at its next boundary; (folder, version) once durable."""
        with self._done:
            target = self._taken + 1
            self._asked.set()
            self._done.wait_for(lambda: self._taken >= target or self.stopped)
            if self._taken < target or self._last is None:
                raise WriteFailed("the learner stopped before it took the checkpoint")
            return self._last

    def checkpoint_taken(self, path: Path, version: int) -> None:
        """The loop: the requested checkpoint is durable."""
        with self._done:
            self._last = (path, version)
            self._taken += 1
            self._done.notify_all()

    def stop(self) -> None:
        """Send `stop` once (the followers return from `follow`); a waiting request fails."""
        if self.stopped:
            return
        self.stopped = True
        broadcast_command(self.ranks, Command("stop"))
        with self._done:
            self._done.notify_all()
