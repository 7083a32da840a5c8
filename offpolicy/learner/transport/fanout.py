"""vLLM's weight-sync control plane for `publish.transport: vllm` (transport/vllm.py): `FanoutClient` carries
the trainer engine's four calls to every member of the transfer group through Redis (weights/control.py)
and waits for their answers, not for the dead's (`Liveness`); `TransferFailed` names who failed a call."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offpolicy.weights.control import LearnerControl, Liveness, Member


class TransferFailed(RuntimeError):
    """Members did not answer a transfer command in time, or answered with an error (`culprits`)."""

    def __init__(self, message: str, culprits: list[str]) -> None:
        super().__init__(message)
        self.culprits = culprits


class FanoutClient:
    """vLLM's weight-sync control plane (the four calls) fanned out to the group's members over Redis."""

    def __init__(
        self,
        control: LearnerControl,
        members: list[Member],
        epoch: int,
        timeout_s: float,
        liveness: Liveness | None = None,
    ) -> None:
        self.control, self.members, self.epoch, self.timeout_s = control, members, epoch, timeout_s
        self.liveness = liveness
        self.version: int | None = None  # set before each send: the members tag what they received
        self.dropped: set[str] = set()  # members found dead in the last update (their answers not awaited)
        self.held: set[str] = set()  # members that answered the last update ok: they hold `version`
        self._answered = threading.Event()  # the last update's answers are in (or it gave up on them)
        self._answered.set()

    @property
    def ids(self) -> list[str]:
        return [m.actor_id for m in self.members]

    def _call(self, body: dict[str, Any], tolerate_dead: bool = False) -> None:
        """Send `body` to every member and wait for their answers (not for the dead's: `Liveness`); an error
        or a missing answer raises `TransferFailed` naming them, except, with `tolerate_dead`, the dead
        (`dropped`: the others' update stands)."""
        token = self.control.command(self.ids, {**body, "epoch": self.epoch}, ttl_s=2 * self.timeout_s)
        acks = self.control.acks(token, self.ids, self.timeout_s, self.liveness)
        if body["op"] == "update":  # before any verdict: a broken send asks who holds the version
            self.held = {a.actor_id for a in acks if a.ok}
        bad = [f"{a.actor_id}: {a.error}" for a in acks if not a.ok]
        missing = sorted(set(self.ids) - {a.actor_id for a in acks})
        if tolerate_dead and missing and not bad and self.liveness is not None:
            dead = self.liveness.dead(self.control.members(), missing)
            self.dropped |= dead
            missing = [i for i in missing if i not in dead]
        if bad or missing:
            raise TransferFailed(
                f"{body['op']} (epoch {self.epoch}): errors {bad or 'none'}; "
                f"no answer in {self.timeout_s:g} s from {missing or 'none'}",
                sorted({a.actor_id for a in acks if not a.ok} | set(missing)),
            )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offsets, rank = {}, init_info.get("rank_offset", 1)
        for m in self.members:  # each actor's workers take the next ranks
            offsets[m.actor_id] = rank
            rank += m.workers
        self._call({"op": "init", "init_info": init_info, "rank_offsets": offsets})

    def start_weight_update(self) -> None:
        """Nothing to do here: a member pauses when the update reaches it (one round trip per update)."""

    def update_weights(self, update_info: Any) -> None:
        assert self.version is not None, "set the version before sending"
        self.held = set()
        self._answered.clear()
        try:
            self._call(
                {"op": "update", "version": self.version, "update_info": update_info}, tolerate_dead=True
            )
        finally:
            self._answered.set()

    def holders(self, timeout_s: float) -> set[str]:
        """Who confirmed the last update, once its answers are in (at most `timeout_s`; none after it). The
        engine stops awaiting them when its broadcast raises, yet members that got every bucket (a peer
        died on the last) confirm the version: a broken send asks, and does not send it to them again."""
        self._answered.wait(timeout_s)
        return set(self.held) if self._answered.is_set() else set()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Nothing to do here: each member finished and tagged the version before answering the update."""

    def leave(self) -> None:
        """Tell the members to drop the group (no answer awaited)."""
        if self.members:
            self.control.command(self.ids, {"op": "leave", "epoch": self.epoch}, ttl_s=2 * self.timeout_s)
