"""The step-boundary commands of a learner on N ranks: what rank 0 (the leader) tells every other rank.

At every step boundary the leader broadcasts a `Command` (msgpack, never pickle) on the control group: the
step's groups as the buffer's own encoded frames, a config that takes effect at this boundary, a
checkpoint request, or stop. `LeaderChannel` is the leader's side: what the next command carries besides
the step's groups (the config the leader applied since the last command, and a checkpoint another thread
asked for with `POST /v1/checkpoints`, which that thread waits on until it is durable). `run_follower` is
every other rank's loop: it runs what the leader sends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import torch
import torch.distributed as dist

from offpolicy.learner.distributed.ranks import Ranks
from offpolicy.learner.errors import WriteFailed

if TYPE_CHECKING:
    from offpolicy.learner.config import LearnerConfig


@dataclass(frozen=True, slots=True)
class Command:
    """What every rank does at this step boundary, in this order: apply `config` (a LearnerConfig as
    JSON, with its `config_version`), train on `groups` (encoded frames, with the `images` they show:
    sha256 -> bytes) when `op == "step"`, then checkpoint when `checkpoint`; `op == "stop"` ends the
    followers."""

    op: str  # "step" | "noop" | "stop"
    groups: list[bytes] = field(default_factory=list)
    config: str | None = None
    config_version: int = 0
    checkpoint: bool = False
    images: dict[str, bytes] = field(default_factory=dict)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "op": self.op,
                "groups": self.groups,
                "config": self.config,
                "config_version": self.config_version,
                "checkpoint": self.checkpoint,
                "images": self.images,
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> Command:
        doc = msgpack.unpackb(data, raw=False)
        return cls(
            op=str(doc["op"]),
            groups=list(doc["groups"]),
            config=doc["config"],
            config_version=int(doc["config_version"]),
            checkpoint=bool(doc["checkpoint"]),
            images={str(k): bytes(v) for k, v in (doc.get("images") or {}).items()},
        )


def run_follower(
    ranks: Ranks, execute: Callable[[Command], object], stop_event: threading.Event | None = None
) -> None:
    """A follower rank's loop: `execute` each command the leader broadcasts until it sends `stop` (or
    `stop_event` is set). The learner gives `execute`: apply the config the command carries, then train,
    publish or checkpoint as the leader does (learner/trainer.py `Learner.run_follower`)."""
    while stop_event is None or not stop_event.is_set():
        command = broadcast_command(ranks, None)
        if command.op == "stop":
            return
        execute(command)


def broadcast_command(ranks: Ranks, command: Command | None) -> Command:
    """Leader: send `command` to every rank (and return it). Follower: pass None, get the leader's."""
    if not ranks.distributed:
        assert command is not None
        return command
    data = command.encode() if ranks.is_leader and command is not None else b""
    size = torch.tensor([len(data)], dtype=torch.long)
    dist.broadcast(size, src=0, group=ranks.control)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if ranks.is_leader
        else torch.empty(int(size), dtype=torch.uint8)
    )
    if int(size):
        dist.broadcast(buf, src=0, group=ranks.control)
    return command if ranks.is_leader and command is not None else Command.decode(buf.numpy().tobytes())


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

    def send(self, op: str, frames: list[bytes], images: dict[str, bytes] | None = None) -> Command:
        """Broadcast this boundary's command: `op`, the groups' frames and images, the unsent config, a
        request."""
        with self._done:  # read and cleared together: a request set in between is never lost
            ask = self._asked.is_set()
            self._asked.clear()
        change, self._unsent = self._unsent, None
        cfg_json, cfg_version = (change[0].model_dump_json(), change[1]) if change else (None, 0)
        command = Command(op, frames, cfg_json, cfg_version, checkpoint=ask, images=images or {})
        return broadcast_command(self.ranks, command)

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
        """Send `stop` once (the followers return from `run_follower`); a waiting request fails."""
        if self.stopped:
            return
        self.stopped = True
        broadcast_command(self.ranks, Command("stop"))
        with self._done:
            self._done.notify_all()
