"""The learner on N ranks, as a mixin of `Learner` (learner/trainer.py): the leader's command at each step
boundary (with the config it applied since the last one, and the step's groups encoded), its heartbeat
while it has nothing to train, its `stop`, and the followers' loop that runs what it sends.

`Learner` provides what these read: `config`, `ranks`, `channel`, `persist`, `state`, `_lock`,
`_pending`, `_step_lock`, `_apply_pending()` and `_execute()`.
"""

from __future__ import annotations

import threading

from offpolicy.buffer.codec import decode_group, encode_group
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.commands import Command, broadcast_command


class CommandLoop:
    """`Learner`'s side of the leader's commands and the followers' loop (module docstring)."""

    def _command(self, op: str, groups: list) -> Command:
        """Leader: tell every rank what this step boundary does, with the config the leader applied since
        the last command (a no-op on one process)."""
        if self.channel is None:
            return Command(op)
        return self.channel.send(op, [encode_group(g, self.config.buffer.limits) for g in groups])

    def heartbeat(self) -> None:
        """Leader with nothing to train: N ranks hear from it (a config change, a checkpoint request)."""
        if self.channel is None:
            return
        self._apply_pending()
        self.persist.poll()
        command = self._command("noop", [])
        if command.checkpoint:
            with self._step_lock:
                self._execute(command, [], {})

    def follow(self, stop_event: threading.Event | None = None) -> None:
        """Follower: run the leader's commands until it sends `stop`."""
        while stop_event is None or not stop_event.is_set():
            command = broadcast_command(self.ranks, None)
            if command.op == "stop":
                return
            if command.config is not None:
                new = LearnerConfig.model_validate_json(command.config)
                with self._lock:
                    self._pending = (new, command.config_version)
                self._apply_pending()
            limits = self.config.buffer.limits
            self.persist.poll()
            self._execute(command, [decode_group(f, limits) for f in command.groups], {})
            if command.op == "step":
                self.state = "running"

    def _stop_followers(self) -> None:
        """Leader: send `stop` once (the followers return from `follow`)."""
        if self.channel is not None:
            self.channel.stop()
