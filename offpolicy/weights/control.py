"""The weight-transfer control plane in Redis: who is in the group, and what the learner asks of them.

`reload.transport: vllm` moves weights learner -> actors through vLLM's weight-transfer engines; Redis only
carries the small control messages around the data plane:

- membership: every receiving actor keeps `<run>:transfer:member:<actor_id>` (JSON: its incarnation,
  worker count, loaded version) alive with a TTL it refreshes (a heartbeat); a key that expires is an
  actor gone. The learner reads the live members at a version boundary (SCAN, a handful of keys).
- commands: the learner pushes JSON commands onto each member's inbox list `<run>:transfer:inbox:<id>`
  (`init`: join the group of `epoch` at `init_info`; `update`: pause, receive `version`, tag it, resume;
  `leave`: drop the group); the actor BLPOPs its inbox and answers each command on the command's ack list
  `<run>:transfer:ack:<token>` ({"actor_id", "ok", "error", "seconds"}), which the learner BLPOPs with a
  deadline. Every list expires, so a dead peer leaves nothing behind. JSON only (no pickle).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from offpolicy.buffer.keys import _prefix
from offpolicy.buffer.storage import async_client, sync_client


@dataclass(frozen=True, slots=True)
class TransferKeys:
    """The control-plane keys of one run."""

    member_prefix: str
    inbox_prefix: str
    ack_prefix: str

    @classmethod
    def for_run(cls, run_id: str) -> TransferKeys:
        p = f"{_prefix(run_id)}:transfer"
        return cls(f"{p}:member:", f"{p}:inbox:", f"{p}:ack:")


@dataclass(frozen=True, slots=True)
class Member:
    """One live receiving actor, as its heartbeat announces it."""

    actor_id: str
    incarnation: str  # new on every actor start: the learner tells a restarted actor from a stuck one
    workers: int  # the engine's inference workers (TP x PP x DP ranks), each a rank of the group
    version: int  # the version its engine holds (informational)
    beats: int = 0  # heartbeats sent so far: a member whose count stops moving is dead or stuck

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Member:
        doc = json.loads(raw)
        return cls(
            str(doc["actor_id"]),
            str(doc["incarnation"]),
            int(doc["workers"]),
            int(doc["version"]),
            int(doc.get("beats", 0)),
        )


class Liveness:
    """Which members are dead by their heartbeats, as the learner sees them (`observe` at every read of the
    members): a member whose record is gone, or whose beat count has not moved for `lapse_s` (the actors'
    `heartbeat_s` and a quarter of it for jitter), is dead, whatever its record's TTL (3 heartbeats) says.
    A member is first seen alive: its count starts moving then."""

    def __init__(self, lapse_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lapse_s, self._clock = lapse_s, clock
        self._seen: dict[tuple[str, str], tuple[int, float]] = {}  # (id, incarnation) -> (beats, since)

    @property
    def poll_s(self) -> float:
        """How often a wait on possibly dead members reads the members again: a tenth of the lapse (at
        least 50 ms, at most 0.25 s), so a death is seen at most that much after its lapse ends."""
        return min(max(0.05, self.lapse_s / 10), 0.25)

    def observe(self, members: Sequence[Member]) -> None:
        now = self._clock()
        for m in members:
            key = (m.actor_id, m.incarnation)
            beats, _ = self._seen.get(key, (None, now))
            if beats != m.beats:
                self._seen[key] = (m.beats, now)

    def stopped(self, m: Member) -> bool:
        """`m`'s beat count has not moved for `lapse_s` (call `observe` first)."""
        beats, since = self._seen.get((m.actor_id, m.incarnation), (m.beats, self._clock()))
        return beats == m.beats and self._clock() - since > self.lapse_s

    def dead(self, live: Sequence[Member], ids: Sequence[str]) -> set[str]:
        """Of `ids`, those dead given `live` (the members read just now; observed here)."""
        self.observe(live)
        by_id = {m.actor_id: m for m in live}
        return {i for i in ids if i not in by_id or self.stopped(by_id[i])}


@dataclass(frozen=True, slots=True)
class Ack:
    """An actor's answer to one command."""

    actor_id: str
    ok: bool
    error: str = ""
    seconds: float = 0.0


class LearnerControl:
    """The learner's side (synchronous; the learner's training thread)."""

    def __init__(self, redis_url: str, run_id: str, socket_timeout_s: float = 10.0) -> None:
        self.keys = TransferKeys.for_run(run_id)
        self._client = sync_client(redis_url, socket_timeout_s)

    def members(self) -> list[Member]:
        """The live members, by actor id."""
        keys = sorted(self._client.scan_iter(match=self.keys.member_prefix + "*", count=100))
        raws = self._client.mget(keys) if keys else []
        return sorted((Member.decode(r) for r in raws if r is not None), key=lambda m: m.actor_id)

    def command(self, actor_ids: list[str], body: dict[str, Any], ttl_s: float) -> str:
        """Push `body` (plus an ack token) onto each actor's inbox; returns the token."""
        token = uuid.uuid4().hex
        msg = json.dumps({**body, "token": token})
        pipe = self._client.pipeline(transaction=False)
        for actor_id in actor_ids:
            inbox = self.keys.inbox_prefix + actor_id
            pipe.rpush(inbox, msg)
            pipe.pexpire(inbox, int(ttl_s * 1000))
        pipe.execute()
        return token

    def acks(
        self, token: str, expected: int | Sequence[str], timeout_s: float, liveness: Liveness | None = None
    ) -> list[Ack]:
        """Up to `expected` answers (a count, or the actor ids) to command `token`, waiting at most
        `timeout_s` in all; with `liveness` (and ids), no longer than it takes to see the silent ones dead
        (`Liveness.lapse_s`): the members are read every `Liveness.poll_s`."""
        ids = None if isinstance(expected, int) else list(expected)
        count = expected if ids is None else len(ids)
        deadline, out = time.monotonic() + timeout_s, []
        key = self.keys.ack_prefix + token
        poll = 5.0 if liveness is None or ids is None else liveness.poll_s
        while len(out) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got = self._client.blpop([key], timeout=min(max(left, 0.01), poll, 5.0))  # < the socket timeout
            if got is not None:
                doc = json.loads(got[1])
                out.append(
                    Ack(doc["actor_id"], bool(doc["ok"]), doc.get("error", ""), doc.get("seconds", 0.0))
                )
            elif liveness is not None and ids is not None:
                missing = [i for i in ids if i not in {a.actor_id for a in out}]
                if missing and liveness.dead(self.members(), missing) == set(missing):
                    break  # every silent one is dead: no answer is coming
        self._client.delete(key)
        return out

    def close(self) -> None:
        self._client.close()


class ActorControl:
    """An actor's side (asyncio, on the engine's loop)."""

    def __init__(self, redis_url: str, run_id: str, actor_id: str, socket_timeout_s: float = 10.0) -> None:
        self.keys = TransferKeys.for_run(run_id)
        self.actor_id = actor_id
        self.incarnation = uuid.uuid4().hex
        self.beats = 0
        self._client = async_client(redis_url, socket_timeout_s)

    async def heartbeat(self, workers: int, version: int, ttl_s: float) -> None:
        """Announce (or keep announcing) this actor as a live member for `ttl_s` seconds."""
        self.beats += 1
        member = Member(self.actor_id, self.incarnation, workers, version, self.beats)
        await self._client.set(self.keys.member_prefix + self.actor_id, member.encode(), px=int(ttl_s * 1000))

    async def leave(self) -> None:
        await self._client.delete(
            self.keys.member_prefix + self.actor_id, self.keys.inbox_prefix + self.actor_id
        )

    async def next_command(self, wait_s: float) -> dict[str, Any] | None:
        """The next command for this actor, or None after `wait_s`."""
        got = await self._client.blpop([self.keys.inbox_prefix + self.actor_id], timeout=wait_s)
        return None if got is None else json.loads(got[1])

    async def answer(
        self, token: str, ok: bool, error: str = "", seconds: float = 0.0, ttl_s: float = 60
    ) -> None:
        key = self.keys.ack_prefix + token
        body = json.dumps({"actor_id": self.actor_id, "ok": ok, "error": error[:500], "seconds": seconds})
        pipe = self._client.pipeline(transaction=False)
        pipe.rpush(key, body)
        pipe.pexpire(key, int(ttl_s * 1000))
        await pipe.execute()

    async def close(self) -> None:
        await self._client.aclose()
