"""At-least-once delivery: the lease API of both buffers (lease, ack, renew, release, dead letters).

A consumer leases groups instead of consuming them (`lease`, sample.lua): each chosen group gets a
lease id, unique per lease, and a deadline (Redis clock). The lease lives in Redis under the consumer's
name, so it survives the consumer's process. Its use counts only when acked (`ack`, lease.lua): then
toward `max_times_sampled`, removal and `sampled_total`. `renew` moves every deadline of a consumer;
`release` ends leases without an ack, and leases past their deadline end so too, lazily, inside the next
insert or sample (both counted `redelivered`): their uses go back to the buffer. A group is sampleable
while acked uses + outstanding leases < `max_times_sampled`, and its payload stays in Redis until its last
use is acked. `dead_letter` sets aside a group that cannot be trained; `dead_letters` lists them.

`LeaseOps` (sync) and `AsyncLeaseOps` are mixed into `ReplayBuffer` / `AsyncReplayBuffer`
(buffer/replay_buffer.py, buffer/async_replay_buffer.py), which provide `_core`, `_call`, `_client`,
`_lease_script` and `_take`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.core import Core, DecodedSample, strip_field
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.script_io import LeaseArgs
from offpolicy.buffer.types import Acked, Leased

_CONSUMER = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_TEXT_MAX = 512  # reason and field strings kept in a dead-letter record, in characters


def check_consumer(consumer: str) -> str:
    """A consumer name is part of a Redis key: 1-128 of `[A-Za-z0-9_.:-]`."""
    if not isinstance(consumer, str) or not _CONSUMER.match(consumer):
        raise ValueError(f"consumer={consumer!r} must match {_CONSUMER.pattern}")
    return consumer


def check_lease_s(lease_s: float) -> float:
    if not isinstance(lease_s, int | float) or not 0.001 <= lease_s <= 7 * 86400:
        raise ValueError(f"lease_s={lease_s!r} must be a number of seconds in [0.001, 604800]")
    return float(lease_s)


def _max_times(cfg: BufferConfig) -> int:
    return cfg.max_times_sampled or 0


_ACK_HEAD = 6  # ack_args' fixed arguments: an ack with fewer has no lease id


def ack_args(
    cfg: BufferConfig,
    keys: BufferKeys,
    consumer: str,
    lease_ids: Sequence[str],
    priorities: Sequence[float | None] | None = None,
) -> list:
    """lease.lua `ack`; with `priorities` (one per lease id, None = unchanged) each id is followed by its
    group's new priority."""
    ids = [str(i) for i in lease_ids]
    head = ["ack", check_consumer(consumer), _max_times(cfg), keys.payload_prefix, keys.consumer_prefix]
    if priorities is None:
        return [*head, "0", *ids]
    if len(priorities) != len(ids):
        raise ValueError(f"{len(priorities)} priorities for {len(ids)} lease ids")
    pairs: list = []
    for lease_id, p in zip(ids, priorities, strict=True):
        if p is not None and not (isinstance(p, int | float) and math.isfinite(p) and p >= 0):
            raise ValueError(f"priority {p!r} of lease {lease_id} must be a finite number >= 0")
        pairs += [lease_id, "" if p is None else repr(float(p))]
    return [*head, "1", *pairs]


def renew_args(keys: BufferKeys, consumer: str, lease_s: float) -> list:
    return [
        "renew",
        check_consumer(consumer),
        max(1, round(check_lease_s(lease_s) * 1000)),
        keys.consumer_prefix,
    ]


def release_args(cfg: BufferConfig, keys: BufferKeys, consumer: str, lease_ids: Sequence[str] | None) -> list:
    ids = [str(i) for i in lease_ids] if lease_ids is not None else []
    return ["release", check_consumer(consumer), _max_times(cfg), keys.consumer_prefix, *ids]


def dead_args(
    cfg: BufferConfig, keys: BufferKeys, consumer: str | None, entries: Sequence[tuple[str, str, str]]
) -> list:
    """lease.lua `dead` for (lease id, or group id when `consumer` is None; reason; field) entries."""
    args: list = [
        "dead",
        "" if consumer is None else check_consumer(consumer),
        _max_times(cfg),
        keys.payload_prefix,
        keys.consumer_prefix,
        cfg.dead_letter_max,
    ]
    for item, reason, field in entries:
        if not isinstance(item, str) or not item:
            raise ValueError(f"a lease id or group id must be a non-empty string, got {item!r}")
        field = str(field)[:_TEXT_MAX]
        args += [item, str(reason)[:_TEXT_MAX], field, strip_field(field)[:128]]
    return args


def poison_entries(taken: DecodedSample) -> list[tuple[str, str, str]]:
    """The dead-letter entries of a sample's poison groups: (lease id or group id, reason, field)."""
    return [(item, f"decode: {e.message}", e.field) for item, _, e in taken.bad]


def parse_dead_letters(raw: list[bytes]) -> list[dict[str, Any]]:
    """The dead-letter list's JSON records (newest first) as dicts: group_id, reason, field, time_ms,
    consumer ("" when set aside by group id), lease_id ("" likewise)."""
    return [json.loads(r) for r in raw]


def leased_result(consumer: str, taken: DecodedSample) -> Leased:
    return Leased(consumer, taken.groups, taken.lease_ids, {gid: e.field for _, gid, e in taken.bad})


def acked_result(core: Core, raw: list) -> Acked:
    acked = int(raw[0])
    core.metrics.acked.inc(acked)
    if int(raw[1]):
        core.metrics.evicted_max_times_sampled.inc(int(raw[1]))
    return Acked(acked, int(raw[1]), tuple(x.decode() for x in raw[2:]))


class LeaseOps:
    """The lease API of `ReplayBuffer` (sync)."""

    def lease(
        self,
        num_groups: int,
        consumer_version: int,
        timeout_s: float = 10.0,
        *,
        consumer: str,
        lease_s: float,
    ) -> Leased:
        """Lease `num_groups` distinct groups to `consumer` for `lease_s` seconds, chosen as `sample`
        chooses (same staleness gate, limiters, waits and errors). Poison groups (a payload that fails
        to decode or validate) are set aside as dead letters and left out (`Leased.dead_lettered`)."""
        lease = LeaseArgs(check_consumer(consumer), check_lease_s(lease_s))
        return leased_result(consumer, self._take(num_groups, consumer_version, timeout_s, lease))

    def ack(
        self, consumer: str, lease_ids: Sequence[str], priorities: Sequence[float | None] | None = None
    ) -> Acked:
        """Acknowledge leases: each use now counts (max_times_sampled, removal, `sampled_total`). Ids that
        are not the consumer's outstanding leases are reported in `Acked.unknown` and change nothing.
        `priorities` (one per id, None = unchanged): the groups that stay in the buffer and have a
        priority (inserted under `prioritized`) take these, atomically with the ack (one script call)."""
        args = ack_args(self.config, self._core.keys, consumer, lease_ids, priorities)
        if len(args) == _ACK_HEAD:
            return Acked(0, 0)
        return acked_result(self._core, self._call(lambda: self._lease_op(args), "ack"))

    def renew(self, consumer: str, lease_s: float) -> int:
        """Move the deadline of every outstanding lease of `consumer` to now + `lease_s`; return how many
        it holds (fewer than the consumer expects: some expired and went back to the buffer)."""
        args = renew_args(self._core.keys, consumer, lease_s)
        return int(self._call(lambda: self._lease_op(args), "renew"))

    def release(self, consumer: str, lease_ids: Sequence[str] | None = None) -> int:
        """End leases without an ack (None: all of `consumer`'s): their uses go back to the buffer
        (counted `redelivered`). Returns how many ended."""
        args = release_args(self.config, self._core.keys, consumer, lease_ids)
        n = int(self._call(lambda: self._lease_op(args), "release"))
        self._core.metrics.redelivered.inc(n)
        return n

    def leases(self, consumer: str) -> list[str]:
        """The outstanding lease ids of `consumer` (ascending)."""
        key = self._core.keys.consumer_prefix + check_consumer(consumer)
        raw = self._call(lambda: self._client.smembers(key), "leases")
        return sorted((x.decode() for x in raw), key=int)

    def dead_letter(self, consumer: str | None, lease_id_or_group: str, reason: str, field: str) -> bool:
        """Set aside a group that decodes but cannot be trained (a token past the vocabulary...): by the
        consumer's lease id, or by group id when `consumer` is None. The group leaves the buffer, a record
        (group_id, reason, field, time) goes on the dead-letter list, `dropped:invalid:<field>` counts it.
        False when the lease is not the consumer's outstanding one (nothing done)."""
        args = dead_args(self.config, self._core.keys, consumer, [(lease_id_or_group, reason, field)])
        n = int(self._call(lambda: self._lease_op(args), "dead letter"))
        self._core.on_dead([field] * n)
        return n == 1

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest `limit` dead-letter records (JSON-safe dicts, newest first)."""
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        raw = self._call(lambda: self._client.lrange(self._core.keys.dead, 0, limit - 1), "dead letters")
        return parse_dead_letters(raw)

    def _set_aside(self, consumer: str | None, taken: DecodedSample) -> None:
        args = dead_args(self.config, self._core.keys, consumer, poison_entries(taken))
        self._call(lambda: self._lease_op(args), "dead letter")
        self._core.on_dead([e.field for _, _, e in taken.bad])

    def _lease_op(self, args: list):
        return self._lease_script(keys=self._core.keys.indexes(), args=args)


class AsyncLeaseOps:
    """The lease API of `AsyncReplayBuffer`: see `LeaseOps`."""

    async def lease(
        self,
        num_groups: int,
        consumer_version: int,
        timeout_s: float = 10.0,
        *,
        consumer: str,
        lease_s: float,
    ) -> Leased:
        """See `LeaseOps.lease`."""
        lease = LeaseArgs(check_consumer(consumer), check_lease_s(lease_s))
        return leased_result(consumer, await self._take(num_groups, consumer_version, timeout_s, lease))

    async def ack(
        self, consumer: str, lease_ids: Sequence[str], priorities: Sequence[float | None] | None = None
    ) -> Acked:
        """See `LeaseOps.ack`."""
        args = ack_args(self.config, self._core.keys, consumer, lease_ids, priorities)
        if len(args) == _ACK_HEAD:
            return Acked(0, 0)
        return acked_result(self._core, await self._call(lambda: self._lease_op(args), "ack"))

    async def renew(self, consumer: str, lease_s: float) -> int:
        """See `LeaseOps.renew`."""
        args = renew_args(self._core.keys, consumer, lease_s)
        return int(await self._call(lambda: self._lease_op(args), "renew"))

    async def release(self, consumer: str, lease_ids: Sequence[str] | None = None) -> int:
        """See `LeaseOps.release`."""
        args = release_args(self.config, self._core.keys, consumer, lease_ids)
        n = int(await self._call(lambda: self._lease_op(args), "release"))
        self._core.metrics.redelivered.inc(n)
        return n

    async def leases(self, consumer: str) -> list[str]:
        """See `LeaseOps.leases`."""
        key = self._core.keys.consumer_prefix + check_consumer(consumer)
        raw = await self._call(lambda: self._client.smembers(key), "leases")
        return sorted((x.decode() for x in raw), key=int)

    async def dead_letter(
        self, consumer: str | None, lease_id_or_group: str, reason: str, field: str
    ) -> bool:
        """See `LeaseOps.dead_letter`."""
        args = dead_args(self.config, self._core.keys, consumer, [(lease_id_or_group, reason, field)])
        n = int(await self._call(lambda: self._lease_op(args), "dead letter"))
        self._core.on_dead([field] * n)
        return n == 1

    async def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """See `LeaseOps.dead_letters`."""
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        key = self._core.keys.dead
        return parse_dead_letters(
            await self._call(lambda: self._client.lrange(key, 0, limit - 1), "dead letters")
        )

    async def _set_aside(self, consumer: str | None, taken: DecodedSample) -> None:
        args = dead_args(self.config, self._core.keys, consumer, poison_entries(taken))
        await self._call(lambda: self._lease_op(args), "dead letter")
        self._core.on_dead([e.field for _, _, e in taken.bad])

    async def _lease_op(self, args: list):
        return await self._lease_script(keys=self._core.keys.indexes(), args=args)
