"""What the Lua scripts take and give back: the ARGV of insert.lua and sample.lua, and their replies parsed.

Pure data, no Redis: buffer/storage.py queues these arguments in its transactions and parses what they
return; buffer/core.py files the replies.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.rate_limiter import SampleStatus


def _num(x: float) -> str:
    return repr(float(x))


IMAGE_GRACE_S = 60.0
"""How long an image that only consumed groups named stays readable after the sample that consumed them
(`ReplayBuffer.images`); it no longer counts in the buffer's bytes meanwhile."""


def insert_args(
    cfg: BufferConfig,
    keys: BufferKeys,
    entries: list[tuple[str, int, float, bytes, str]],
    max_bytes: int = 0,
    sent_images: str = "",
) -> list:
    """ARGV of insert.lua for (group_id, policy_version, priority, payload, images) entries (`images`: the
    distinct sha256 digests the group names, space-separated): metadata and payload lengths only (the
    payloads, and the images in `sent_images`, are SET NX in the same transaction: storage.py's
    `insert_transaction`). `max_bytes`: the byte budget in force (0: none), resolved by the buffer
    (`Core.max_bytes`)."""
    _, max_diff = cfg.limiter_bounds()
    ratio = cfg.samples_per_insert is not None
    args: list = [
        cfg.max_size,
        "1" if ratio else "0",
        _num(cfg.samples_per_insert or 0.0),
        _num(max_diff if ratio else 0.0),
        cfg.min_size_to_sample,
        "1" if cfg.sampler == "prioritized" else "0",
        keys.payload_prefix,
        cfg.max_times_sampled or 0,
        keys.consumer_prefix,
        cfg.dedupe_window or 0,
        round(cfg.dedupe_window_s * 1000) if cfg.dedupe_window_s is not None else 0,
        max_bytes,
        sent_images,
    ]
    for gid, version, priority, payload, images in entries:
        args += [gid, version, _num(priority), len(payload), images]
    return args


@dataclass(frozen=True, slots=True)
class InsertReply:
    """insert.lua's reply: per-entry status (1 inserted, 0 duplicate, 2 rate limited, 3 over max_bytes, 4
    an image it names neither stored nor sent),
    removals, the leases it found expired (returned to the buffer), the payload bytes stored after it, and
    the used groups it evicted to make room for bytes."""

    statuses: list[int]
    size: int
    evicted: int
    evicted_unsampled: int
    expired: int = 0
    bytes: int = 0
    evicted_bytes: int = 0

    @classmethod
    def parse(cls, raw: list) -> InsertReply:
        return cls([int(s) for s in raw[0]], *(int(x) for x in raw[1:7]))


@dataclass(frozen=True, slots=True)
class LeaseArgs:
    """Who leases a sample and for how long (None in `sample_args`: the sample consumes)."""

    consumer: str
    lease_s: float


def sample_args(
    cfg: BufferConfig,
    keys: BufferKeys,
    k: int,
    consumer_version: int,
    out_prefix: str,
    lease: LeaseArgs | None = None,
) -> list:
    """ARGV of sample.lua, with a fresh random seed."""
    min_diff, _ = cfg.limiter_bounds()
    ratio = cfg.samples_per_insert is not None
    return [
        k,
        consumer_version,
        -1 if cfg.max_staleness is None else cfg.max_staleness,
        cfg.max_times_sampled or 0,
        cfg.sampler,
        secrets.randbits(31),
        cfg.min_size_to_sample,
        "1" if ratio else "0",
        _num(cfg.samples_per_insert or 0.0),
        _num(min_diff if ratio else 0.0),
        _num(cfg.priority_epsilon),
        keys.payload_prefix,
        out_prefix,
        lease.consumer if lease else "",
        max(1, round(lease.lease_s * 1000)) if lease else 0,
        keys.consumer_prefix,
        _num(cfg.priority_alpha),
        round(IMAGE_GRACE_S * 1000),
    ]


@dataclass(frozen=True, slots=True)
class SampleReply:
    """sample.lua's reply with the payloads its transaction read: verdict, size after, removals, leases
    it found expired, the chosen group ids and their payloads (None: gone from Redis behind the buffer's
    back), and, when leasing, each one's lease id ("" where the payload was gone: not leased)."""

    status: SampleStatus
    size: int
    stale: int
    consumed: int
    expired: int
    chosen: list[str]
    payloads: list[bytes | None]
    lease_ids: list[str]

    @classmethod
    def parse(cls, raw: list, payloads: list[bytes | None], leasing: bool) -> SampleReply:
        ids = [x.decode() for x in raw[5:]]
        n = len(ids) // 2 if leasing else len(ids)
        return cls(
            SampleStatus(int(raw[0])), int(raw[1]), int(raw[2]), int(raw[3]), int(raw[4]),
            ids[:n], payloads[:n], ids[n:],
        )  # fmt: skip
