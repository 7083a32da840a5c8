"""What the sync and async replay buffers share: encoding batches, filing script replies, metrics, stats,
and the insert loop (`Core.insert_steps`): its retry policy written once, as the steps of I/O it needs,
which each shell performs its own way (a blocking call, or an await)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from offpolicy.buffer.codec import decode_group
from offpolicy.buffer.codec_batch import decode_groups, encode_groups
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.errors import BufferFull, InvalidTrajectory, RateLimited
from offpolicy.buffer.images import bad_images, chunk_images
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.metrics import BufferMetrics
from offpolicy.buffer.rate_limiter import Backoff, check_sample_size
from offpolicy.buffer.samplers import group_priority
from offpolicy.buffer.script_io import InsertReply, SampleReply
from offpolicy.buffer.types import BufferStats, InsertResult, TrajectoryGroup

_INDEX = re.compile(r"\[\d+\]")
_CHUNK_BYTES = 4 * 1024 * 1024  # one insert transaction carries at most this much payload (or one group)
_CHUNK_GROUPS = 1000  # and at most this many groups (insert.lua unpacks 2 values per group in one call)
Entry = tuple[str, int, float, bytes, str]  # group_id, policy_version, priority, payload, its images
MAXMEMORY_REFRESH_S = 30.0  # a derived max_bytes follows a `CONFIG SET maxmemory` within this long
TABLE_REFRESH_S = 1.0  # a following producer reads the learner's table config at most this often
log = logging.getLogger(__name__)


class Core:
    """Config, keys, codec and metrics bookkeeping shared by the sync and async buffers."""

    def __init__(
        self, run_id: str, config: BufferConfig, registry: CollectorRegistry | None, follow: bool = False
    ) -> None:
        self.cfg = config
        self.keys = BufferKeys.for_run(run_id)
        self.metrics = BufferMetrics(registry if registry is not None else CollectorRegistry())
        self.max_bytes = 0  # the byte budget in force (0: none); see `needs_maxmemory`, `set_maxmemory`
        self._maxmemory_at: float | None = None  # when Redis' maxmemory was last read (None: never)
        self.follow = follow  # adopt the learner's table-wide fields (`keys.table`)
        self._table_at: float | None = None  # when the table config was last read
        self._table_raw: bytes | None = None  # the last one adopted (or refused)

    def table_due(self) -> bool:
        """Whether this insert reads the learner's table config too (following, at most every
        TABLE_REFRESH_S)."""
        now = time.monotonic()
        if not self.follow or (self._table_at is not None and now - self._table_at < TABLE_REFRESH_S):
            return False
        self._table_at = now
        return True

    def adopt(self, raw: bytes | None) -> bool:
        """Take the table-wide fields of the learner's config `raw` (None: none published), keeping the
        local ones (`LOCAL_FIELDS`); True when the config changed. One that does not validate is logged
        once and ignored."""
        if raw is None or raw == self._table_raw:
            return False
        self._table_raw = raw
        try:
            new = self.cfg.with_table(raw)
        except ValidationError as e:
            log.warning("the learner's buffer config is not valid here (ignored): %s", e)
            return False
        changed = sorted(k for k in type(new).model_fields if getattr(new, k) != getattr(self.cfg, k))
        if not changed:
            return False
        log.info("buffer config from the learner: %s", ", ".join(f"{k}={getattr(new, k)!r}" for k in changed))
        self.cfg = new
        self.reconfigured()
        return True

    def set_config(self, config: BufferConfig) -> None:
        """A new local config (`reconfigure`): the learner's table fields are applied over it again at the
        next read."""
        self.cfg, self._table_raw, self._table_at = config, None, None
        self.reconfigured()

    def needs_maxmemory(self) -> bool:
        """Whether the next insert must (re)read Redis' `maxmemory` first: `max_bytes` None derives the
        budget from it, read at the first insert and every MAXMEMORY_REFRESH_S after."""
        if self.cfg.max_bytes is not None:
            self.max_bytes = self.cfg.max_bytes
            return False
        at = self._maxmemory_at
        return at is None or time.monotonic() - at > MAXMEMORY_REFRESH_S

    def set_maxmemory(self, maxmemory: int) -> None:
        """The budget derived from Redis' `maxmemory` (0: none set, so no bound): `max_bytes_share` of it."""
        self.max_bytes = int(self.cfg.max_bytes_share * maxmemory) if maxmemory > 0 else 0
        self._maxmemory_at = time.monotonic()

    def reconfigured(self) -> None:
        """A new config: derive the budget again at the next insert."""
        self._maxmemory_at = None

    def buffer_full(self, reply: InsertReply, inserted: list[str]) -> BufferFull:
        """The error of an insert the script refused for bytes (status 3); `inserted`: the batch's groups
        stored before the refusal."""
        self.metrics.full_by["max_bytes"].inc()
        return BufferFull(
            f"buffer full: {reply.bytes} payload bytes stored of max_bytes={self.max_bytes} "
            f"({len(inserted)} group(s) of the batch inserted before that; retrying the batch is safe)",
            inserted=tuple(inserted),
        )

    def prepare(
        self, groups: Sequence[TrajectoryGroup], images: Mapping[str, bytes] | None = None
    ) -> tuple[list[list[Entry]], dict[str, InvalidTrajectory]]:
        """Validate and encode (once); return insert chunks and the rejections by group_id (or "#<index>").
        A group naming an image whose bytes in `images` do not hash to its name is rejected (`images[i]`)."""
        chunks: list[list[Entry]] = [[]]
        size = 0
        rejected: dict[str, InvalidTrajectory] = {}
        prioritized = self.cfg.sampler == "prioritized"  # the script ignores priorities otherwise
        bad = bad_images(images or {})
        for i, (g, payload) in enumerate(zip(groups, encode_groups(groups, self.cfg.limits), strict=True)):
            if not isinstance(payload, InvalidTrajectory) and bad and g.images:
                payload = next(
                    (
                        InvalidTrajectory(f"images[{j}]", bad[sha])
                        for j, sha in enumerate(g.images)
                        if sha in bad
                    ),
                    payload,
                )
            if isinstance(payload, InvalidTrajectory):
                key = g.group_id if isinstance(g.group_id, str) and g.group_id else f"#{i}"
                rejected[key] = payload
                self.metrics.rejected.labels(_INDEX.sub("", payload.field)).inc()
                continue
            if chunks[-1] and (size + len(payload) > _CHUNK_BYTES or len(chunks[-1]) == _CHUNK_GROUPS):
                chunks.append([])
                size = 0
            priority = group_priority(g) if prioritized else 0.0
            chunks[-1].append(
                (g.group_id, g.policy_version, priority, payload, " ".join(dict.fromkeys(g.images)))
            )
            size += len(payload)
        return [c for c in chunks if c], rejected

    def rejected_counts(self, rejected: dict[str, InvalidTrajectory]) -> dict[str, int]:
        """Counter increments for the `counters` hash: rejected:<field without indices>."""
        counts: dict[str, int] = {}
        for e in rejected.values():
            name = f"rejected:{_INDEX.sub('', e.field)}"
            counts[name] = counts.get(name, 0) + 1
        return counts

    def insert_steps(
        self, groups: Sequence[TrajectoryGroup], images: Mapping[str, bytes] | None = None
    ) -> Generator[InsertStep, Any, InsertOutcome]:
        """Insert a batch, as the steps of I/O it needs: the shell performs each step yielded and sends
        back its result (`InsertStep`). The retry policy lives here alone: a chunk goes again, less what
        the script filed (inserted or duplicate), while the samples_per_insert limiter refuses some of it,
        with `backoff` until `insert_timeout_s` is spent (then `RateLimited`); a refusal for max_bytes
        raises `BufferFull` at once. A group naming an image neither in `images` nor stored is rejected
        (`images`) by the script, alone. Returns (inserted group ids, duplicate ones, rejections by group
        id)."""
        t0 = time.perf_counter()
        chunks, rejected = self.prepare(groups, images)
        if rejected:
            yield CountRejected(self.rejected_counts(rejected))
        inserted: list[str] = []
        dups: list[str] = []
        backoff = None
        if chunks and self.needs_maxmemory():
            self.set_maxmemory((yield ReadMaxmemory()))
        for pending in chunks:
            while pending:
                sent = chunk_images(pending, images)
                reply = InsertReply.parse((yield SendChunk(pending, self.max_bytes, self.table_due(), sent)))
                self.on_insert(reply)
                pending, full = file_statuses(pending, reply, inserted, dups, rejected)
                if 4 in reply.statuses:
                    self.metrics.rejected.labels("images").inc(reply.statuses.count(4))
                if full:
                    raise self.buffer_full(reply, inserted)
                if pending:
                    backoff = backoff or self.backoff(self.cfg.insert_timeout_s)
                    delay = backoff.delay()
                    if delay is None:
                        raise insert_limited(self.cfg, len(inserted))
                    self.metrics.waits["insert"].inc()
                    yield Wait(delay)
        self.metrics.insert_latency.observe(time.perf_counter() - t0)
        return inserted, dups, rejected

    def on_insert(self, reply: InsertReply) -> None:
        m = self.metrics
        if reply.expired:
            m.redelivered.inc(reply.expired)
        m.inserts.inc(reply.statuses.count(1))
        if 0 in reply.statuses:
            m.duplicates.inc(reply.statuses.count(0))
        if reply.evicted:
            m.evicted_max_size.inc(reply.evicted)
        if reply.evicted_unsampled:
            m.dropped_evicted_unsampled.inc(reply.evicted_unsampled)
        if reply.evicted_bytes:
            m.evicted_max_bytes.inc(reply.evicted_bytes)
        m.payload_bytes.set(reply.bytes)
        self._size(reply.size)

    def on_sample(self, reply: SampleReply) -> None:
        m = self.metrics
        if reply.expired:
            m.redelivered.inc(reply.expired)
        if reply.stale:
            m.dropped_stale.inc(reply.stale)
        if reply.consumed:
            m.evicted_max_times_sampled.inc(reply.consumed)
        self._size(reply.size)

    def _size(self, size: int) -> None:
        self.metrics.size.set(size)
        self.metrics.fill_ratio.set(size / self.cfg.max_size)

    def missing(self, payloads: list[bytes | None]) -> int:
        """How many chosen groups had no payload (deleted behind the buffer's back, e.g. by a maxmemory
        policy); the script counted them as dropped `payload_missing` in Redis, this in the metrics."""
        missing = payloads.count(None)
        if missing:
            self.metrics.dropped_payload_missing.inc(missing)
        return missing

    def take(self, reply: SampleReply, consumer_version: int) -> DecodedSample:
        """The chosen groups of an OK reply, each decoded and validated on its own: the valid ones (with
        their lease ids when leasing), and the invalid ones to set aside (dead letters) by lease id, or by
        group id when the sample consumed. Missing payloads are skipped (`missing` counted them)."""
        leasing = bool(reply.lease_ids)
        items = reply.lease_ids if leasing else reply.chosen
        kept = [
            (p, i, g) for p, i, g in zip(reply.payloads, items, reply.chosen, strict=True) if p is not None
        ]
        try:
            decoded: list = decode_groups([p for p, _, _ in kept], self.cfg.limits)
        except InvalidTrajectory:  # a poison group: decode each on its own to name it and keep the rest
            decoded = [_decode_one(p, self.cfg.limits) for p, _, _ in kept]
        taken = DecodedSample([], [], [])
        for (_, item, gid), g in zip(kept, decoded, strict=True):
            if isinstance(g, InvalidTrajectory):
                taken.bad.append((item, gid, g))
            else:
                taken.groups.append(g)
                taken.lease_ids.append(item)
        (self.metrics.leased if leasing else self.metrics.samples).inc(len(taken.groups))
        observe = self.metrics.sampled_staleness.observe
        for g in taken.groups:
            observe(max(consumer_version - g.policy_version, 0))
        return taken

    def on_dead(self, fields: list[str]) -> None:
        """Count groups set aside as dead letters, by field (indices stripped; unknown fields: `other`)."""
        for f in fields:
            reason = f"invalid:{strip_field(f)}"
            self.metrics.dropped_invalid.get(reason, self.metrics.dropped_invalid["invalid:other"]).inc()

    def check_sample(self, num_groups: int) -> None:
        if self.cfg.samples_per_insert is not None:
            check_sample_size(num_groups, *self.cfg.limiter_bounds())
        elif num_groups < 1:
            raise ValueError(f"num_groups={num_groups} must be >= 1")

    def backoff(self, timeout_s: float) -> Backoff:
        return Backoff(timeout_s, self.cfg.backoff_initial_s, self.cfg.backoff_max_s)

    def fresh_floor(self, producer_version: int) -> str:
        """Lowest policy_version a learner at `producer_version` may still sample (ZCOUNT's min)."""
        if self.cfg.max_staleness is None:
            return "-inf"
        return str(producer_version - self.cfg.max_staleness)

    def queue_stats(self, pipe) -> None:
        """Queue the reads `stats` decodes: counters, size, the stored version range, held and leases."""
        k = self.keys
        pipe.hgetall(k.counters).zcard(k.order)
        pipe.zrange(k.by_version, 0, 0, withscores=True).zrevrange(k.by_version, 0, 0, withscores=True)
        pipe.hlen(k.held).hlen(k.leases)

    def stats(self, counters: dict, size: int, lo: list, hi: list, held: int, leases: int) -> BufferStats:
        c = {k.decode(): int(v) for k, v in counters.items()}
        size += held

        def by(prefix: str) -> dict[str, int]:
            return {k[len(prefix) :]: v for k, v in c.items() if k.startswith(prefix)}

        return BufferStats(
            size=size,
            payload_bytes=c.get("bytes", 0),
            max_size=self.cfg.max_size,
            fill_ratio=size / self.cfg.max_size,
            inserted_total=c.get("inserted", 0),
            duplicates_total=c.get("duplicates", 0),
            sampled_total=c.get("sampled", 0),
            evicted_total=by("evicted:"),
            dropped_total=by("dropped:"),
            rejected_total=by("rejected:"),
            policy_version_min=int(lo[0][1]) if lo else None,
            policy_version_max=int(hi[0][1]) if hi else None,
            leased_total=c.get("leased", 0),
            acked_total=c.get("acked", 0),
            redelivered_total=c.get("redelivered", 0),
            leases_outstanding=leases,
            held=held,
            images=c.get("images", 0),
            image_bytes=c.get("image_bytes", 0),
        )


@dataclass(slots=True)
class DecodedSample:
    """A sample reply's chosen groups, decoded: the valid ones (and their lease ids, when leasing) and the
    poison ones, to set aside: (lease id or group id, group id, the error)."""

    groups: list[TrajectoryGroup]
    lease_ids: list[str]
    bad: list[tuple[str, str, InvalidTrajectory]]


# --- the insert loop's steps of I/O (`Core.insert_steps`): what each asks of a shell, what it sends back

InsertOutcome = tuple[list[str], list[str], dict[str, InvalidTrajectory]]


@dataclass(frozen=True, slots=True)
class CountRejected:
    """Add `counts` to the buffer's counters hash (one pipeline); sends back nothing."""

    counts: dict[str, int]
    what: ClassVar[str] = "count rejected"


@dataclass(frozen=True, slots=True)
class ReadMaxmemory:
    """Read Redis' `maxmemory` (storage.read_maxmemory); sends back the bytes (0: none)."""

    what: ClassVar[str] = "read maxmemory"


@dataclass(frozen=True, slots=True)
class SendChunk:
    """Run one insert transaction of `entries` (storage.insert_transaction, with `max_bytes` and, with
    `read_table`, the learner's table config read in it); the shell hands the table config it read to
    `_adopt`, then sends back the script's raw reply. Redis refusing it at its maxmemory is
    back-pressure (`full_on_oom`: `BufferFull`), not an outage."""

    entries: list[Entry]
    max_bytes: int
    read_table: bool
    images: Mapping[str, bytes] = field(default_factory=dict)  # sha256 -> bytes: the images to SET NX
    what: ClassVar[str] = "insert"
    full_on_oom: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Wait:
    """Sleep `seconds` (the limiter refused part of a chunk); sends back nothing."""

    seconds: float


InsertStep = CountRejected | ReadMaxmemory | SendChunk | Wait


def strip_field(field: str) -> str:
    """A field path without indices: `trajectories[2].reward` -> `trajectories.reward`."""
    return _INDEX.sub("", field)


def _decode_one(payload: bytes, limits) -> TrajectoryGroup | InvalidTrajectory:
    try:
        return decode_group(payload, limits)
    except InvalidTrajectory as e:
        return e


def file_statuses(
    chunk: list[Entry],
    reply: InsertReply,
    inserted: list[str],
    dups: list[str],
    rejected: dict[str, InvalidTrajectory],
) -> tuple[list[Entry], bool]:
    """File each entry of `chunk` by its status; return the entries refused (by the rate limiter, or over
    max_bytes) and whether the refusal was max_bytes (status 3: BufferFull, no waiting here). A group
    naming an image neither sent nor stored (status 4) joins `rejected`."""
    refused: list[Entry] = []
    full = False
    for entry, status in zip(chunk, reply.statuses, strict=True):
        if status == 1:
            inserted.append(entry[0])
        elif status == 0:
            dups.append(entry[0])
        elif status == 4:
            rejected[entry[0]] = InvalidTrajectory(
                "images", "names an image that is neither sent with the batch nor stored in the buffer"
            )
        else:
            refused.append(entry)
            full = full or status == 3
    return refused, full


def insert_limited(cfg: BufferConfig, inserted: int) -> RateLimited:
    return RateLimited(
        f"samples_per_insert limiter refused inserts for insert_timeout_s={cfg.insert_timeout_s} "
        f"({inserted} inserted before that; retrying the batch is safe)"
    )


def make_result(inserted: list[str], dups: list[str], rejected: dict[str, InvalidTrajectory]) -> InsertResult:
    return InsertResult(tuple(inserted), tuple(dups), {k: e.field for k, e in rejected.items()})


def merge_priorities(indexed: list, held: list) -> list[float | None]:
    """Per group: its score in the priority index, else the priority of its `held` record ("seq pv pr",
    "-" = none), else None."""
    out: list[float | None] = []
    for score, meta in zip(indexed, held, strict=True):
        if score is not None:
            out.append(float(score))
        elif meta is not None and meta.split()[2] != b"-":
            out.append(float(meta.split()[2]))
        else:
            out.append(None)
    return out
