"""The records that cross process boundaries (groups of trajectories) and the buffer's result types."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# 6: + image references (vision-language prompts), written only for groups that carry them;
# 5: + routed experts (MoE), written only for groups that carry them (the others are still written as 4);
# 4: the frame header's keys are the record's field names; 3: + environment-token spans (agents);
# 2: the zero-copy frame (buffer/codec.py); 1: msgpack
SCHEMA_VERSION = 6
READABLE_SCHEMA_VERSIONS = (2, 3, 4, 5, 6)  # frames of schema 2 decode as all-policy trajectories
ROUTED_SCHEMA_VERSION = 5  # the first schema with routed experts: a group carrying them needs a reader of it
IMAGES_SCHEMA_VERSION = 6  # the first with image references: a group showing images needs its reader
PLAIN_SCHEMA_VERSION = 4  # the schema a group without routed experts is written as (readers of 4 read it)
MAX_EXPERTS = 65_536  # most experts per MoE layer a record can name (uint16)
REWARD_EXTRA_PREFIX = "reward_extra/"
"""A group's metadata keys for the extra figures its reward returned beside the score (a verl reward's
`{"score": 1.0, "acc": True}`: `reward_extra/acc`, the mean over the group's completions as text); the
learner's per-`data_source` metrics read them."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling parameters an actor generated a group with."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off (vLLM's convention)
    max_tokens: int = 256


@dataclass(slots=True)
class Trajectory:
    """One completion: its tokens, the behaviour log-prob of each, and its reward.

    A multi-turn or tool-using episode is one completion whose response holds every turn after the prompt:
    the tokens the policy generated (`policy_mask` True: trained, their log-probs and versions meaningful)
    and the tokens the environment inserted (False: tool results, user turns; attended, never trained).

    `routed_experts` (MoE models whose actor captures routing, `engine.return_routed_experts`): row `j` holds,
    for each of the model's L MoE layers, the K experts (top_k, in the router's order) that the actor's
    forward at the position before response token `j` (prompt length + j - 1, the forward whose logits
    sampled token j) routed to. Every response token has a row, environment tokens included: theirs are
    the routing of the prefill that read them (the next turn's request, under that turn's weights); rows
    no forward computed (environment tokens after the last policy turn, or a first response token with
    an empty prompt) hold experts `0..K-1`, and no trained token depends on them. The prompt's positions
    but its last carry no rows: the learner routes them itself (no replay there). The expert indices are
    in [0, `TrajectoryGroup.num_experts`), dtype `routed_dtype(num_experts)` (uint8 up to 256 experts).

    Decoded groups (`decode_group`, `ReplayBuffer.sample`) hold read-only views into their payload (no
    copies; the payload stays in memory while any view does): a consumer that writes to an array
    copies it first (`a.copy()`).
    """

    response_ids: np.ndarray  # int32[R]
    behavior_logprobs: np.ndarray  # float32[R], finite, <= 0
    reward: float
    finish_reason: str  # "stop" | "length" | ...
    versions: np.ndarray | None = None  # int32[R]: policy version per token, when a completion spans a reload
    policy_mask: np.ndarray | None = (
        None  # bool[R]: True on policy tokens, False on environment ones; None = all
    )
    routed_experts: np.ndarray | None = None  # uint8|uint16[R, L, K]: MoE routing per token (see below)


def routed_dtype(num_experts: int) -> np.dtype:
    """The compact dtype of routed experts (expert indices in [0, num_experts)): uint8 up to 256 experts,
    else uint16 (up to `MAX_EXPERTS`)."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


def env_spans(policy_mask: np.ndarray | None) -> list[int]:
    """The environment tokens of a mask as flat half-open spans `[start0, end0, start1, end1, ...]`
    (empty when every token is the policy's): how a frame carries the mask."""
    if policy_mask is None:
        return []
    env = np.concatenate(([0], (~policy_mask).view(np.int8), [0]))
    edges = np.flatnonzero(np.diff(env))  # starts and ends alternate
    return edges.tolist()


def mask_from_spans(spans: list[int], length: int) -> np.ndarray | None:
    """`env_spans`' inverse: the policy mask of a completion of `length` tokens (None without spans)."""
    if not spans:
        return None
    mask = np.ones(length, dtype=bool)
    for start, end in zip(spans[::2], spans[1::2], strict=True):
        mask[start:end] = False
    return mask


@dataclass(slots=True)
class TrajectoryGroup:
    """All completions of one prompt: the unit of insert and sample (group-relative advantages need it)."""

    group_id: str  # uuid4 hex: the idempotency key
    prompt_id: str
    prompt_ids: np.ndarray  # int32[P]
    policy_version: int  # version of the weights that generated the group
    actor_id: str
    created_at: float  # unix seconds
    sampling: SamplingParams
    trajectories: list[Trajectory]  # n >= 1
    metadata: dict[str, str] = field(default_factory=dict)
    priority: float | None = None  # for the `prioritized` sampler; None = |advantage| proxy
    schema_version: int = SCHEMA_VERSION
    num_experts: int | None = None  # experts per MoE layer of the model; set when a trajectory has routing
    images: list[str] = field(default_factory=list)
    """The images the group's sequences show, by content (sha256, 64 lowercase hex digits), in the order
    of their placeholders: the prompt's, then those the environment inserted into each trajectory's
    response (an agent's screenshots), trajectory by trajectory. The buffer stores each image once, as a
    blob shared by every group that names it (`ReplayBuffer.insert_many(..., images=)`); a consumer reads
    them with `ReplayBuffer.images`."""

    @property
    def num_tokens(self) -> int:
        """Response tokens over all trajectories of the group."""
        return sum(len(t.response_ids) for t in self.trajectories)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What `insert_many` did with each group of a batch, by `group_id`."""

    inserted: tuple[str, ...] = ()
    duplicates: tuple[str, ...] = ()
    rejected: dict[str, str] = field(default_factory=dict)  # group_id (or "#<index>") -> failing field

    @property
    def ok(self) -> bool:
        """True when nothing was rejected."""
        return not self.rejected


@dataclass(frozen=True, slots=True)
class BufferStats:
    """A snapshot of one buffer (one run): size, lifetime counters, and the learner's buffer position.

    `inserted_total` and `sampled_total` are the buffer position a learner checkpoints: they only grow,
    and they are what the `samples_per_insert` rate limiter compares.
    """

    size: int  # groups stored now
    max_size: int
    fill_ratio: float  # size / max_size
    inserted_total: int  # groups accepted since the buffer was created (or cleared)
    duplicates_total: int  # inserts that were no-ops because the group_id had been seen
    sampled_total: int  # groups handed out by `sample` (a group sampled twice counts twice)
    evicted_total: dict[str, int]  # removals by the remover: "max_size", "max_times_sampled", "max_bytes"
    dropped_total: dict[str, int]  # data lost: "stale" (past max_staleness), "evicted_unsampled"
    rejected_total: dict[str, int]  # invalid groups by field name (indices stripped)
    policy_version_min: int | None  # oldest policy_version stored; None when empty
    policy_version_max: int | None  # newest policy_version stored; None when empty
    leased_total: int = 0  # leases handed out by `lease` (a group leased twice counts twice)
    acked_total: int = 0  # leases acknowledged (each also counts in `sampled_total`)
    redelivered_total: int = 0  # leases that ended without an ack (released or expired): the use went back
    leases_outstanding: int = 0  # leases handed out and not yet acked, released, expired or dead-lettered
    held: int = 0  # stored groups not sampleable now: leased up to max_times_sampled (part of `size`)
    payload_bytes: int = 0  # payload bytes of the stored groups, leased ones included (max_bytes counts it)
    images: int = 0  # images stored (each once, however many stored groups name it)
    image_bytes: int = 0  # their bytes (part of payload_bytes)


@dataclass(frozen=True, slots=True)
class Leased:
    """What `lease` hands out: the groups and, index for index, one lease id each (unique per lease: a
    group leased twice gets two). Ack the ids once the update that used them is durable."""

    consumer: str
    groups: list[TrajectoryGroup]
    lease_ids: list[str]  # lease_ids[i] leases groups[i]
    dead_lettered: dict[str, str] = field(default_factory=dict)  # group_id -> field, set aside by this call


@dataclass(frozen=True, slots=True)
class Acked:
    """What `ack` did: leases acknowledged, groups that left the buffer with it (last use acked), and
    the ids that were not this consumer's outstanding leases (acked before, released, expired)."""

    acked: int
    retired: int
    unknown: tuple[str, ...] = ()
