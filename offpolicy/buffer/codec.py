"""Encode/decode `TrajectoryGroup` as a versioned zero-copy frame: msgpack header + raw little-endian arrays.

Wire format (schema_version 4, or 5 for a group with routed experts; 3 and 2 decode too), every number
little-endian:

    bytes 0-3    magic b"OPTG"
    bytes 4-5    schema_version, uint16
    bytes 6-9    H, the header's length in bytes, uint32
    bytes 10..   the header: a msgpack map of H bytes (below)
    zero padding to the next multiple of 8 bytes: the array section starts there
    arrays       int32 lens[n] | int32 prompt_ids[P] | int32 response_ids[T] | int32 versions[V]
                 | float32 behavior_logprobs[T] | schema 5: uint8|uint16 routed_experts[T', L, K]

The header (schema 4) names each value by the record's own field name (docs/glossary.md): `{"group_id",
"prompt_id", "policy_version", "actor_id", "created_at", "sampling": [temperature, top_p, top_k,
max_tokens], "metadata": {str: str}, "priority": float | nil, "reward": [float] * n, "finish_reason":
[str] * n, "has_versions": [bool] * n, "env_spans": [spans] * n, "array_ends": [5 byte offsets]}`.
`env_spans` holds each trajectory's environment tokens (`Trajectory.policy_mask` False: tool results,
user turns) as flat half-open spans `[start0, end0, ...]`, empty when the policy generated every token;
`array_ends` gives where each array ends, counted from the start of the array section (each starts where
the previous ends, the first at 0; the last end is the section's length). `response_ids` and
`behavior_logprobs` hold every trajectory's tokens in order (`lens[i]` each); `versions` those of the
trajectories whose `has_versions` is true.

Schema 5 is schema 4 plus MoE routing: the header's `routed_experts` entry (`{"num_experts", "layers",
"top_k", "has": [bool] * n}`) and, after the log-probs (past `array_ends[4]`, to the frame's end), the
routed trajectories' expert indices (buffer/routing.py). Only a group that carries routed experts is
written as schema 5, so readers of schema 4 keep reading every other group, and refuse a routed one by its
version (`unknown schema version 5`) instead of dropping its routing.

Schema 6 is schema 5 plus the header's `images` entry: the sha256 hex digests of the images the group's
sequences show (`TrajectoryGroup.images`; the image bytes are blobs of their own in the buffer). Only a
group that shows images is written as schema 6, so a reader of 5 refuses it by its version instead of
training on its image placeholders without the images.

Schemas 2 and 3 wrote the same values under short keys (`SHORT_KEYS`: `gid`, `pid`, `pv`, `aid`, `t`,
`s`, `m`, `pr`, `rw`, `fr`, `hv`, `env`, `a`); schema 2 has no `env` (all-policy trajectories). Their
headers are renamed to schema 4's keys once, as they are parsed; everything after reads one layout.

Decoding parses the prefix and the header and takes numpy views of the arrays without copying (read-only
when the payload is `bytes`; they keep the payload alive), checks their values with three reductions
over the whole group, and hands each trajectory slices of them. Encoding packs the header and joins it
with the arrays' own buffers (the one copy), then runs the same value checks on the frame.
Never pickle.
"""

from __future__ import annotations

import struct
from itertools import accumulate, compress, repeat
from operator import attrgetter
from typing import Any

import msgpack
import numpy as np

from offpolicy.buffer.codec_plain import plain
from offpolicy.buffer.config import CodecLimits
from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.routing import KEY, frame_routing, header_entry, routed_arrays, split
from offpolicy.buffer.types import (
    IMAGES_SCHEMA_VERSION,
    PLAIN_SCHEMA_VERSION,
    READABLE_SCHEMA_VERSIONS,
    ROUTED_SCHEMA_VERSION,
    SCHEMA_VERSION,
    SamplingParams,
    Trajectory,
    TrajectoryGroup,
    env_spans,
    mask_from_spans,
)
from offpolicy.buffer.validation import (
    DEFAULT_LIMITS,
    check_counts,
    check_header,
    check_images,
    check_lengths,
    check_offsets,
    check_spans,
    check_values,
    header_ok,
    raise_bad_values,
    validate_group,
)

__all__ = [
    "MAGIC",
    "SHORT_KEYS",
    "CodecLimits",
    "build",
    "decode_group",
    "encode_group",
    "frame",
    "parse",
    "plain",
    "raise_frame_values",
    "validate_group",
]

MAGIC = b"OPTG"
PREFIX = struct.Struct("<4sHI")  # magic, schema_version, header length
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_PAD = bytes(8)
_ids, _behavior_logprobs = attrgetter("response_ids"), attrgetter("behavior_logprobs")
_versions = attrgetter("versions")
_reward, _reason = attrgetter("reward"), attrgetter("finish_reason")
SHORT_KEYS = {  # schemas 2 and 3's header keys -> schema 4's (the record's field names)
    "gid": "group_id",
    "pid": "prompt_id",
    "pv": "policy_version",
    "aid": "actor_id",
    "t": "created_at",
    "s": "sampling",
    "m": "metadata",
    "pr": "priority",
    "rw": "reward",
    "fr": "finish_reason",
    "hv": "has_versions",
    "env": "env_spans",
    "a": "array_ends",
}


def _array_section(header_bytes: int) -> int:
    """Offset of the array section: after the prefix and the header, rounded up to 8 bytes."""
    return (PREFIX.size + header_bytes + 7) & ~7


# --- encode


def _converted(g: TrajectoryGroup) -> tuple[np.ndarray, list, list, list]:
    """The group's arrays as the frame holds them (copies only where the dtype or layout differs)."""
    trs = g.trajectories
    return (
        np.ascontiguousarray(g.prompt_ids, _I32),
        [np.ascontiguousarray(t.response_ids, _I32) for t in trs],
        [np.ascontiguousarray(t.versions, _I32) for t in trs if t.versions is not None],
        [np.ascontiguousarray(t.behavior_logprobs, _F32) for t in trs],
    )


def encode_group(group: TrajectoryGroup, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    """Validate `group` and encode it to one frame (raises `InvalidTrajectory` naming the field)."""
    if plain([group], limits):
        return frame(group, limits)
    validate_group(group, limits)
    return frame(group, limits, *_converted(group))


def frame(
    g: TrajectoryGroup,
    limits: CodecLimits,
    prompt: np.ndarray | None = None,
    ids: list[np.ndarray] | None = None,
    versions: list[np.ndarray] | None = None,
    behavior_logprobs_list: list[np.ndarray] | None = None,
    *,
    values_checked: bool = False,
) -> bytes:
    """The frame of `g`, whose other checks passed (`plain` or `validate_group`), from its own arrays
    or the converted ones given; checks the size and, unless the caller has (`values_checked`), the array
    values on the frame's own bytes (raises naming the field)."""
    trs = g.trajectories
    if prompt is None:
        prompt, ids = g.prompt_ids, list(map(_ids, trs))
        behavior_logprobs_list = list(map(_behavior_logprobs, trs))
        versions = [t.versions for t in trs if t.versions is not None]
    lens = list(map(len, ids))
    tokens = 4 * sum(lens)
    routed = routed_arrays(g)  # the routed experts (the exact path checked them), compact dtype
    ends = list(accumulate((4 * len(lens), prompt.nbytes, tokens, 4 * sum(map(len, versions)), tokens)))
    s = g.sampling
    doc = {
        "group_id": g.group_id,
        "prompt_id": g.prompt_id,
        "policy_version": g.policy_version,
        "actor_id": g.actor_id,
        "created_at": float(g.created_at),
        "sampling": [float(s.temperature), float(s.top_p), int(s.top_k), int(s.max_tokens)],
        "metadata": dict(g.metadata),
        "priority": None if g.priority is None else float(g.priority),
        "reward": list(map(float, map(_reward, trs))),
        "finish_reason": list(map(_reason, trs)),
        "has_versions": [t.versions is not None for t in trs],
        "env_spans": [env_spans(t.policy_mask) for t in trs],
        "array_ends": ends,
    }
    if routed:
        doc[KEY] = header_entry(g, routed)
    if g.images:
        check_images(g.images, limits)
        doc["images"] = g.images
    head = msgpack.packb(doc, use_bin_type=True)
    base = _array_section(len(head))
    version = IMAGES_SCHEMA_VERSION if g.images else ROUTED_SCHEMA_VERSION if routed else PLAIN_SCHEMA_VERSION
    prefix = PREFIX.pack(MAGIC, version, len(head))
    pad = _PAD[: base - PREFIX.size - len(head)]
    lens_bytes = struct.pack(f"<{len(lens)}i", *lens)
    arrays = [prefix, head, pad, lens_bytes, prompt, *ids, *versions, *behavior_logprobs_list, *routed]
    data = b"".join(arrays)
    if len(data) > limits.max_payload_bytes:
        raise InvalidTrajectory(
            "payload", f"{len(data)} bytes exceeds max_payload_bytes={limits.max_payload_bytes}"
        )
    if values_checked:
        return data
    ints = np.frombuffer(data, _I32, (ends[3] - ends[0]) // 4, base + ends[0])  # prompt, ids, versions
    behavior_logprobs = np.frombuffer(data, _F32, (ends[4] - ends[3]) // 4, base + ends[3])
    if not check_values(ints, behavior_logprobs):
        all_ids, versions_list = np.concatenate(ids), list(map(_versions, trs))
        raise_bad_values(np.array(lens), prompt, all_ids, behavior_logprobs, versions_list, limits)
    return data


# --- decode


def _frame_header(data: bytes, limits: CodecLimits) -> tuple[dict, int, int, bool]:
    """Check the prefix and parse the header: (header, number of trajectories, array section offset,
    whether routed experts follow the arrays)."""
    size = len(data)
    if size > limits.max_payload_bytes:
        raise InvalidTrajectory(
            "payload", f"{size} bytes exceeds max_payload_bytes={limits.max_payload_bytes}"
        )
    if size < PREFIX.size:
        raise InvalidTrajectory(
            "payload", f"truncated: {size} bytes, shorter than the {PREFIX.size}-byte prefix"
        )
    magic, version, head = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise InvalidTrajectory(
            "payload", f"bad magic {magic!r}, expected {MAGIC!r} (not a group frame of schema_version >= 2)"
        )
    if version not in READABLE_SCHEMA_VERSIONS:
        raise InvalidTrajectory("schema_version", f"unknown schema version {version!r}")
    base = _array_section(head)
    if base > size:
        raise InvalidTrajectory("payload", f"truncated: a {head}-byte header does not fit in {size} bytes")
    try:
        doc = msgpack.unpackb(
            memoryview(data)[PREFIX.size : PREFIX.size + head], raw=False, strict_map_key=True
        )
    except (ValueError, msgpack.UnpackException) as e:
        raise InvalidTrajectory("payload", f"the header is not valid msgpack: {e}") from e
    if version < 4:  # short keys (schemas 2 and 3): renamed once, then read as schema 4's
        doc = _full_names(doc)
    n = len(doc["reward"]) if header_ok(doc, limits) else check_header(doc, limits)
    return doc, n, base, version >= ROUTED_SCHEMA_VERSION and doc.get(KEY) is not None


def _full_names(doc: Any) -> Any:
    """A schema 2 or 3 header map under schema 4's keys (`SHORT_KEYS`); anything else as it is, for
    `check_header` to name."""
    if type(doc) is not dict:
        return doc
    get = SHORT_KEYS.get
    return {get(k, k): v for k, v in doc.items()}


def _version_views(vers: np.ndarray, lens: list[int], hv: list[bool]) -> list[np.ndarray | None]:
    """Each trajectory's slice of the versions array, or None where it has none."""
    out, v = [], 0
    for length, has in zip(lens, hv, strict=True):
        out.append(vers[v : v + length] if has else None)
        v += length if has else 0
    return out


def parse(
    data: bytes, limits: CodecLimits
) -> tuple[dict, list[int], np.ndarray, np.ndarray, np.ndarray | None]:
    """Everything of a frame checked but its int32 and log-prob values: (header, trajectory lengths, the
    int32 values after the lengths (prompt ids, token ids, versions), the log-probs, the routed experts
    [T', L, K] of the routed trajectories or None (checked whole)); views, no copies."""
    doc, n, base, routed = _frame_header(data, limits)
    ends, hv = doc["array_ends"], doc["has_versions"]
    e0, e1, e2, e3, e4 = ends
    section = len(data) - base  # routed experts (schema 5) follow the five arrays
    arrays_end = e4 if routed and e4 <= section else section
    if (e0 | e1 | e2 | e3 | e4) & 3 or not 0 <= e0 <= e1 <= e2 <= e3 <= e4 == arrays_end:
        check_offsets(ends, arrays_end)
    ints = np.frombuffer(data, _I32, e3 >> 2, base)  # lens, prompt, ids, versions
    lens = ints[:n].tolist()
    tokens = 4 * sum(lens)
    if not (
        e0 == 4 * n
        and min(lens) >= 1
        and max(lens) <= limits.max_tokens_per_completion
        and e1 - e0 <= 4 * limits.max_prompt_tokens
        and e2 - e1 == tokens == e4 - e3
        and e3 - e2 == (4 * sum(compress(lens, hv)) if True in hv else 0)
    ):
        check_counts(ends, check_lengths(ints, n, ends, limits), hv)
    env = doc.get("env_spans")
    if env is not None and (type(env) is not list or len(env) != n or any(env)):
        check_spans(env, lens)  # environment tokens (schema >= 3): checked only where there are any
    view = frame_routing(doc, lens, data, base + e4, len(data))[0] if routed else None
    if "images" in doc:
        check_images(doc["images"], limits)
    return doc, lens, ints[n:], np.frombuffer(data, _F32, (e4 - e3) >> 2, base + e3), view


def _split(doc: dict, ints: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """prompt ids, token ids, versions: views of `ints`."""
    ends = doc["array_ends"]
    p, t = (ends[1] - ends[0]) // 4, (ends[2] - ends[0]) // 4
    return ints[:p], ints[p:t], ints[t:]


def raise_frame_values(
    doc: dict, lens: list[int], ints: np.ndarray, behavior_logprobs: np.ndarray, limits: CodecLimits
) -> None:
    """A parsed frame failed `check_values`: raise naming the field."""
    prompt, ids, vers = _split(doc, ints)
    versions = _version_views(vers, lens, doc["has_versions"])
    raise_bad_values(np.array(lens), prompt, ids, behavior_logprobs, versions, limits)


def build(
    doc: dict,
    lens: list[int],
    ints: np.ndarray,
    behavior_logprobs: np.ndarray,
    routed: np.ndarray | None = None,
) -> TrajectoryGroup:
    """The group of a parsed, checked frame; its arrays are views of the frame."""
    prompt, ids, vers = _split(doc, ints)
    hv, env = doc["has_versions"], doc.get("env_spans")
    versions = _version_views(vers, lens, hv) if True in hv else repeat(None)
    masks = (
        (mask_from_spans(s, n) for s, n in zip(env, lens, strict=True)) if env and any(env) else repeat(None)
    )
    entry = doc.get(KEY) if routed is not None else None
    experts = split(routed, lens, entry["has"]) if entry else repeat(None)
    trajs, a = [], 0
    rewards, reasons = doc["reward"], doc["finish_reason"]
    rows = zip(lens, rewards, reasons, versions, masks, experts, strict=False)  # repeat(None)
    for length, r, f, v, m, x in rows:
        b = a + length
        trajs.append(Trajectory(ids[a:b], behavior_logprobs[a:b], float(r), f, v, m, x))
        a = b
    pr = doc.get("priority")
    return TrajectoryGroup(
        doc["group_id"],
        doc["prompt_id"],
        prompt,
        doc["policy_version"],
        doc["actor_id"],
        float(doc["created_at"]),
        SamplingParams(*doc["sampling"]),
        trajs,
        doc["metadata"],
        None if pr is None else float(pr),
        SCHEMA_VERSION,
        entry["num_experts"] if entry else None,
        doc.get("images") or [],
    )


def decode_group(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> TrajectoryGroup:
    """Decode and validate one frame; any problem raises `InvalidTrajectory` naming the field.

    The arrays are views into `data` (read-only for `bytes`), no copies."""
    doc, lens, ints, behavior_logprobs, routed = parse(data, limits)
    if not check_values(ints, behavior_logprobs):
        raise_frame_values(doc, lens, ints, behavior_logprobs, limits)
    return build(doc, lens, ints, behavior_logprobs, routed)
