"""Every Redis key and channel name of a run; all share the hash tag `{run_id}` (one Cluster slot)."""

from __future__ import annotations

from dataclasses import dataclass

from offpolicy.config.base import check_run_id


def _prefix(run_id: str) -> str:
    return f"offpolicy:{{{check_run_id(run_id)}}}"


@dataclass(frozen=True, slots=True)
class BufferKeys:
    """The keys of one buffer: the indexes (the scripts' KEYS, in declaration order) and the per-group
    keys: the payload of each stored group, `<payload_prefix><group_id>`, and the keys a sample hands
    payloads out through, `<out_prefix><call token>:<i>` (the scripts get the prefixes in ARGV)."""

    order: str  # zset group_id -> insert sequence number (fifo / newest / eviction order)
    by_version: str  # zset group_id -> policy_version (staleness gate and weights)
    uses: str  # hash group_id -> times sampled (absent = 0)
    priority: str  # zset group_id -> priority (prioritized sampler only)
    seen: str  # zset group_id -> insert time (ms): the dedupe window (bounded by count and/or age)
    counters: str  # hash of lifetime counters (inserted, sampled, leased, acked, evicted:*, dropped:*...)
    leases: str  # hash lease_id -> "<consumer> <group_id>": every outstanding lease
    deadlines: str  # zset lease_id -> deadline (ms, Redis clock): expired leases go back lazily
    leased: str  # hash group_id -> outstanding leases (absent = 0)
    held: (
        str  # hash group_id -> "seq pv priority": stored, out of the sampler indexes (leased to its last use)
    )
    dead: str  # list of JSON dead-letter records, newest first, bounded by dead_letter_max
    sizes: str  # hash group_id -> payload bytes of each stored group (their sum: counters `bytes`)
    images: str  # hash sha256 -> stored groups naming that image; the image's bytes: `<images>:<sha256>`
    group_images: str  # hash group_id -> the distinct images it names ("sha sha ..."), where it names any
    table: str  # string: the learner's table-wide BufferConfig fields as JSON; producers adopt them
    payload_prefix: str  # string per stored group: the encoded group
    out_prefix: str  # strings living inside one sample transaction: the chosen payloads, read and deleted
    consumer_prefix: str  # set per consumer: its outstanding lease ids, `<consumer_prefix><consumer>`

    @classmethod
    def for_run(cls, run_id: str) -> BufferKeys:
        """The keys of `run_id`'s buffer."""
        p = _prefix(run_id)
        return cls(
            order=f"{p}:buf:order",
            by_version=f"{p}:buf:version",
            uses=f"{p}:buf:uses",
            priority=f"{p}:buf:priority",
            seen=f"{p}:buf:dedupe",  # a zset; `buf:seen` (a set, unbounded) was its name before
            counters=f"{p}:buf:counters",
            leases=f"{p}:buf:lease",
            deadlines=f"{p}:buf:lease:deadline",
            leased=f"{p}:buf:leased",
            held=f"{p}:buf:held",
            dead=f"{p}:buf:dead",
            sizes=f"{p}:buf:bytes",
            images=f"{p}:buf:img",
            group_images=f"{p}:buf:gimg",
            table=f"{p}:buf:config",
            payload_prefix=f"{p}:buf:g:",
            out_prefix=f"{p}:buf:out:",
            consumer_prefix=f"{p}:buf:lease:c:",
        )

    def indexes(self) -> list[str]:
        """KEYS for the scripts, in declaration order (scripts/lib.lua names them)."""
        return [
            self.order, self.by_version, self.uses, self.priority, self.seen, self.counters,
            self.leases, self.deadlines, self.leased, self.held, self.dead, self.sizes, self.images,
            self.group_images,
        ]  # fmt: skip

    def payload(self, group_id: str) -> str:
        """The key holding `group_id`'s encoded group."""
        return self.payload_prefix + group_id

    def image(self, sha: str) -> str:
        """The key holding the bytes of the image whose sha256 is `sha` (stored once, however many groups
        name it; deleted with the last of them)."""
        return f"{self.images}:{sha}"

    def out(self, token: str) -> str:
        """The prefix of one sample call's out keys (`<prefix><i>`, i = 1..k, as the script numbers them)."""
        return f"{self.out_prefix}{token}:"

    def per_group_patterns(self) -> list[str]:
        """SCAN MATCH patterns of every payload, image, out and consumer key (run ids hold no glob
        characters)."""
        return [
            self.payload_prefix + "*", self.images + ":*", self.out_prefix + "*", self.consumer_prefix + "*",
        ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class PolicyKeys:
    """The policy record key and the channel its updates are announced on."""

    record: str  # string: JSON PolicyRecord
    channel: str  # pub/sub channel: JSON PolicyRecord on every publish

    @classmethod
    def for_run(cls, run_id: str) -> PolicyKeys:
        """The policy keys of `run_id`."""
        p = _prefix(run_id)
        return cls(record=f"{p}:policy", channel=f"{p}:policy:announce")
