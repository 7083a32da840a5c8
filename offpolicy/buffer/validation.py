"""The record contract: every check on a group or on a decoded frame, raising `InvalidTrajectory(field)`.

Two kinds of callers: `validate_group` checks a `TrajectoryGroup` object field by field (the exact path
of `encode_group`); `header_ok` / `check_header` check a decoded frame's header, `check_offsets`,
`check_lengths`, `check_counts` the layout of its arrays, and `check_values` / `raise_bad_values` their
values (`buffer/codec.py`). The `*_ok` / `check_values` forms are the fast path (one boolean); the others
run only when it fails, to name the field. Value checks run over a group's
concatenated arrays with a few numpy reductions; only a failed one searches for the trajectory to name.
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
from bisect import bisect_right
from itertools import accumulate
from typing import Any

import numpy as np

from offpolicy.buffer.config import CodecLimits
from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.routing import check_group as check_routing
from offpolicy.buffer.types import READABLE_SCHEMA_VERSIONS, Trajectory, TrajectoryGroup

__all__ = [
    "check_counts",
    "check_header",
    "check_images",
    "check_lengths",
    "check_offsets",
    "check_values",
    "header_ok",
    "images_ok",
    "raise_bad_values",
    "validate_group",
]

I32_MAX = 2**31 - 1
_NUM = frozenset((float, int))
_STR = frozenset((str,))
_BOOL = frozenset((bool,))
DEFAULT_LIMITS = CodecLimits()
_INT = frozenset((int,))
_DICT = frozenset((dict,))
_LIST = frozenset((list,))


# --- a TrajectoryGroup object (validate_group)


def _check_ids(a: Any, name: str, limit: int, limit_name: str) -> None:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
        raise InvalidTrajectory(name, f"must be a 1-D integer array, got {type(a).__name__}")
    if len(a) > limit:
        raise InvalidTrajectory(name, f"{len(a)} tokens exceeds {limit_name}={limit}")
    if len(a) and (a.min() < 0 or a.max() > I32_MAX):
        raise InvalidTrajectory(name, f"token ids must be in [0, 2^31), got min {a.min()}, max {a.max()}")


def _check_traj(t: Trajectory, i: int) -> None:
    """Types and lengths of one trajectory (values are checked over the whole group at once)."""
    pre = f"trajectories[{i}]"
    ids, behavior_logprobs = t.response_ids, t.behavior_logprobs
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidTrajectory(
            f"{pre}.response_ids", f"must be a 1-D integer array, got {type(ids).__name__}"
        )
    if (
        not isinstance(behavior_logprobs, np.ndarray)
        or behavior_logprobs.ndim != 1
        or behavior_logprobs.dtype.kind != "f"
    ):
        raise InvalidTrajectory(f"{pre}.behavior_logprobs", "must be a 1-D float array")
    if len(ids) == 0:
        raise InvalidTrajectory(f"{pre}.response_ids", "an empty completion (0 tokens)")
    if len(behavior_logprobs) != len(ids):
        raise InvalidTrajectory(
            f"{pre}.behavior_logprobs", f"length {len(behavior_logprobs)} != len(response_ids) {len(ids)}"
        )
    v = t.versions
    if v is not None:
        if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype.kind not in "iu" or len(v) != len(ids):
            raise InvalidTrajectory(f"{pre}.versions", f"must be a 1-D integer array of length {len(ids)}")
        if len(v) and (v.min() < 0 or v.max() > I32_MAX):
            raise InvalidTrajectory(f"{pre}.versions", "versions must be in [0, 2^31)")
    m = t.policy_mask
    if m is not None:
        if not isinstance(m, np.ndarray) or m.ndim != 1 or m.dtype != np.bool_ or len(m) != len(ids):
            raise InvalidTrajectory(f"{pre}.policy_mask", f"must be a 1-D bool array of length {len(ids)}")
        if not m.any():
            raise InvalidTrajectory(f"{pre}.policy_mask", "no policy token: nothing to train on")
    if not isinstance(t.reward, int | float) or isinstance(t.reward, bool) or not math.isfinite(t.reward):
        raise InvalidTrajectory(f"{pre}.reward", f"must be a finite number, got {t.reward!r}")
    if not isinstance(t.finish_reason, str):
        raise InvalidTrajectory(f"{pre}.finish_reason", "must be a string")


def _check_group_header(group: TrajectoryGroup, limits: CodecLimits) -> None:
    """Identity, version, time, prompt and trajectory count."""
    if group.schema_version not in READABLE_SCHEMA_VERSIONS:
        raise InvalidTrajectory("schema_version", f"unknown schema version {group.schema_version!r}")
    for name in ("group_id", "prompt_id", "actor_id"):
        value = getattr(group, name)
        if not isinstance(value, str) or not value:
            raise InvalidTrajectory(name, f"must be a non-empty string, got {value!r}")
    if not isinstance(group.policy_version, int) or group.policy_version < 0:
        raise InvalidTrajectory("policy_version", f"must be an int >= 0, got {group.policy_version!r}")
    if not isinstance(group.created_at, int | float) or not math.isfinite(group.created_at):
        raise InvalidTrajectory("created_at", f"must be finite unix seconds, got {group.created_at!r}")
    _check_ids(group.prompt_ids, "prompt_ids", limits.max_prompt_tokens, "max_prompt_tokens")
    if not group.trajectories:
        raise InvalidTrajectory("trajectories", "a group needs at least one trajectory")
    if len(group.trajectories) > limits.max_completions_per_group:
        raise InvalidTrajectory(
            "trajectories",
            f"{len(group.trajectories)} exceeds max_completions_per_group={limits.max_completions_per_group}",
        )


_SHA256 = re.compile(r"[0-9a-f]{64}")


def images_ok(images: Any, limits: CodecLimits) -> bool:
    """A group's image references as a frame takes them: a list of sha256 hex digests (lowercase), within
    `max_images_per_group` (`check_images` names what is wrong otherwise)."""
    return (
        type(images) is list
        and len(images) <= limits.max_images_per_group
        and all(type(x) is str and _SHA256.fullmatch(x) for x in images)
    )


def check_images(images: Any, limits: CodecLimits) -> None:
    """Raise naming the first bad image reference."""
    if images_ok(images, limits):
        return
    if type(images) is not list:
        raise InvalidTrajectory("images", f"must be a list of sha256 digests, got {type(images).__name__}")
    if len(images) > limits.max_images_per_group:
        raise InvalidTrajectory(
            "images", f"{len(images)} exceeds max_images_per_group={limits.max_images_per_group}"
        )
    i = next(i for i, x in enumerate(images) if not (type(x) is str and _SHA256.fullmatch(x)))
    raise InvalidTrajectory(
        f"images[{i}]", f"must be a sha256 digest (64 lowercase hex digits), got {images[i]!r}"
    )


def mask_ok(m: Any, length: int) -> bool:
    """A trajectory's `policy_mask` as a frame takes it: None, or a bool array of its length with a policy
    token (`_check_traj` names what is wrong otherwise)."""
    return m is None or (
        type(m) is np.ndarray and m.dtype == np.bool_ and m.shape == (length,) and bool(m.any())
    )


def check_spans(env: Any, lens: list[int]) -> None:
    """A frame's environment spans (header key `env_spans`, schemas >= 3): per trajectory a flat list of
    increasing half-open `[start, end)` pairs inside the completion that leave a policy token."""
    if type(env) is not list or len(env) != len(lens):
        raise InvalidTrajectory("trajectories.policy_mask", f"must be a list of {len(lens)} span lists")
    for i, (spans, length) in enumerate(zip(env, lens, strict=True)):
        if type(spans) is not list or len(spans) % 2 or not all(type(x) is int for x in spans):
            raise InvalidTrajectory(f"trajectories[{i}].policy_mask", "spans must be pairs of ints")
        bounds = [0, *spans, length]
        if any(a > b for a, b in itertools.pairwise(bounds)) or any(
            s >= e for s, e in zip(spans[::2], spans[1::2], strict=True)
        ):
            raise InvalidTrajectory(
                f"trajectories[{i}].policy_mask", f"spans {spans} are not increasing inside [0, {length})"
            )
        if sum(e - s for s, e in zip(spans[::2], spans[1::2], strict=True)) == length:
            raise InvalidTrajectory(f"trajectories[{i}].policy_mask", "no policy token: nothing to train on")


def _number(x: Any) -> bool:
    """A real number that is not a bool (numpy scalars included)."""
    return type(x) in _NUM or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _check_rest(priority: Any, metadata: Any, sampling: Any) -> None:
    """The group-level fields after the trajectories: priority, metadata, sampling."""
    if priority is not None and (not _number(priority) or not math.isfinite(priority) or priority < 0):
        raise InvalidTrajectory("priority", f"must be finite and >= 0, got {priority!r}")
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidTrajectory("metadata", "must map str to str")
    if len(sampling) != 4 or not all(map(_number, sampling)):
        raise InvalidTrajectory(
            "sampling", f"must be [temperature, top_p, top_k, max_tokens], got {sampling}"
        )
    temperature, top_p, _, max_tokens = sampling
    if not (math.isfinite(temperature) and temperature > 0 and 0 < top_p <= 1 and max_tokens >= 1):
        raise InvalidTrajectory("sampling", f"invalid sampling parameters {sampling}")


def validate_group(group: TrajectoryGroup, limits: CodecLimits = DEFAULT_LIMITS) -> None:
    """Raise `InvalidTrajectory(field, message)` for the first field of `group` that breaks the contract."""
    _check_group_header(group, limits)
    for i, t in enumerate(group.trajectories):
        _check_traj(t, i)
    trs = group.trajectories
    lens = np.array([len(t.response_ids) for t in trs], dtype=np.int64)
    ids = np.concatenate([t.response_ids for t in trs])
    behavior_logprobs = np.concatenate([t.behavior_logprobs for t in trs]).astype(np.float32, copy=False)
    raise_bad_values(lens, np.zeros(0, np.int32), ids, behavior_logprobs, [None] * len(trs), limits)
    s = group.sampling
    _check_rest(group.priority, group.metadata, (s.temperature, s.top_p, s.top_k, s.max_tokens))
    check_routing(group)  # routed experts (MoE): buffer/routing.py
    check_images(group.images, limits)


# --- array values (a frame's views, or validate_group's concatenations)


def check_values(ints: np.ndarray, behavior_logprobs: np.ndarray) -> bool:
    """True when every int32 (prompt ids, token ids, versions) is >= 0 and every log-prob finite and <= 0.

    NaN fails `max <= 0`; int32 values cannot exceed 2^31 - 1.
    """
    return (not len(ints) or ints.min() >= 0) and (
        not len(behavior_logprobs) or (behavior_logprobs.max() <= 0 and behavior_logprobs.min() > -np.inf)
    )


def raise_bad_values(
    lens: np.ndarray,
    prompt: np.ndarray,
    ids: np.ndarray,
    behavior_logprobs: np.ndarray,
    versions: list[np.ndarray | None],
    limits: CodecLimits,
) -> None:
    """Raise naming the first bad value: prompt ids, trajectory lengths, token ids, log-probs, versions."""
    if len(prompt) and prompt.min() < 0:
        raise InvalidTrajectory("prompt_ids", f"token ids must be in [0, 2^31), got {prompt.min()}")
    ends = np.cumsum(lens)

    def where(pos: int) -> str:
        return f"trajectories[{int(np.searchsorted(ends, pos, side='right'))}]"

    if len(lens) and lens.max() > limits.max_tokens_per_completion:
        i = int(lens.argmax())
        raise InvalidTrajectory(
            f"trajectories[{i}].response_ids",
            f"{lens[i]} tokens exceeds max_tokens_per_completion={limits.max_tokens_per_completion}",
        )
    if len(ids) and (ids.min() < 0 or ids.max() > I32_MAX):
        pos = int(np.argmax((ids < 0) | (ids > I32_MAX)))
        raise InvalidTrajectory(
            f"{where(pos)}.response_ids", f"token ids must be in [0, 2^31), got {ids[pos]}"
        )
    ok = behavior_logprobs <= 0  # False for nan too
    finite = np.isfinite(behavior_logprobs)
    if not ok.all() or not finite.all():
        pos = int(np.argmax(~(ok & finite)))
        what = (
            "contains a non-finite value"
            if not finite[pos]
            else f"log-probs must be <= 0, got {behavior_logprobs[pos]}"
        )
        raise InvalidTrajectory(f"{where(pos)}.behavior_logprobs", what)
    for i, v in enumerate(versions):
        if v is not None and len(v) and v.min() < 0:
            raise InvalidTrajectory(f"trajectories[{i}].versions", "versions must be in [0, 2^31)")


# --- a decoded frame: its header and the layout of its arrays (decode_group)


def _get(doc: dict, field: str, types: frozenset) -> Any:
    if field not in doc:
        raise InvalidTrajectory(field, "missing")
    value = doc[field]
    if type(value) not in types:
        raise InvalidTrajectory(field, f"wrong type {type(value).__name__}")
    return value


def _per_trajectory(doc: dict, key: str, name: str, n: int, types: frozenset) -> list:
    lst = doc.get(key)
    if type(lst) is not list or len(lst) != n:
        raise InvalidTrajectory(f"trajectories.{name}", f"must be a list of {n}")
    if not set(map(type, lst)) <= types:
        i = next(i for i, x in enumerate(lst) if type(x) not in types)
        raise InvalidTrajectory(f"trajectories[{i}].{name}", f"wrong type {type(lst[i]).__name__}")
    return lst


def check_header(doc: Any, limits: CodecLimits) -> int:
    """Check a frame's header map, under schema 4's keys (everything but the array values); return the
    number of trajectories."""
    if type(doc) is not dict:
        raise InvalidTrajectory("payload", "the frame header must be a msgpack map")
    for field in ("group_id", "prompt_id", "actor_id"):
        if not _get(doc, field, _STR):
            raise InvalidTrajectory(field, "must be a non-empty string")
    if _get(doc, "policy_version", _INT) < 0:
        raise InvalidTrajectory("policy_version", f"must be an int >= 0, got {doc['policy_version']}")
    if not math.isfinite(_get(doc, "created_at", _NUM)):
        raise InvalidTrajectory("created_at", f"must be finite unix seconds, got {doc['created_at']}")
    rw = doc.get("reward")
    if type(rw) is not list:
        raise InvalidTrajectory("trajectories.reward", "must be a list, one reward per trajectory")
    n = len(rw)
    if n == 0:
        raise InvalidTrajectory("trajectories", "a group needs at least one trajectory")
    if n > limits.max_completions_per_group:
        raise InvalidTrajectory(
            "trajectories", f"{n} exceeds max_completions_per_group={limits.max_completions_per_group}"
        )
    _per_trajectory(doc, "reward", "reward", n, _NUM)
    if not all(map(math.isfinite, rw)):
        i = next(i for i, r in enumerate(rw) if not math.isfinite(r))
        raise InvalidTrajectory(f"trajectories[{i}].reward", f"must be a finite number, got {rw[i]}")
    _per_trajectory(doc, "finish_reason", "finish_reason", n, _STR)
    _per_trajectory(doc, "has_versions", "versions", n, _BOOL)
    _check_rest(doc.get("priority"), _get(doc, "metadata", _DICT), _get(doc, "sampling", _LIST))
    ends = doc.get("array_ends")
    if type(ends) is not list or len(ends) != 5 or not set(map(type, ends)) <= _INT:
        raise InvalidTrajectory("payload", f"array offsets must be a list of 5 ints, got {ends!r}")
    return n


def header_ok(d: Any, limits: CodecLimits) -> bool:
    """`check_header` as one expression: True when it would pass (the per-group fast path of decode)."""
    if type(d) is not dict:
        return False
    get = d.get
    g, p, a, pv = get("group_id"), get("prompt_id"), get("actor_id"), get("policy_version")
    t, rw, fr, hv = get("created_at"), get("reward"), get("finish_reason"), get("has_versions")
    s, m, pr, ends = get("sampling"), get("metadata"), get("priority"), get("array_ends")
    return (
        type(g) is str
        and type(p) is str
        and type(a) is str
        and g != ""
        and p != ""
        and a != ""
        and type(pv) is int
        and pv >= 0
        and type(t) in _NUM
        and math.isfinite(t)
        and type(rw) is list
        and type(fr) is list
        and type(hv) is list
        and 0 < len(rw) == len(fr) == len(hv) <= limits.max_completions_per_group
        and set(map(type, rw)) <= _NUM
        and all(map(math.isfinite, rw))
        and set(map(type, fr)) <= _STR
        and set(map(type, hv)) <= _BOOL
        and type(s) is list
        and len(s) == 4
        and set(map(type, s)) <= _NUM
        and math.isfinite(s[0])
        and s[0] > 0
        and 0 < s[1] <= 1
        and s[3] >= 1
        and type(m) is dict
        and set(map(type, m)) <= _STR
        and set(map(type, m.values())) <= _STR
        and (pr is None or (type(pr) in _NUM and math.isfinite(pr) and pr >= 0))
        and type(ends) is list
        and len(ends) == 5
        and set(map(type, ends)) <= _INT
    )


def _first_short(lens: list[int], count: int) -> int:
    """The first trajectory whose tokens an array of `count` values does not fully hold (or the last)."""
    return min(bisect_right(list(accumulate(lens)), count), len(lens) - 1)


def check_offsets(ends: list[int], section: int) -> None:
    """The arrays the header describes lie inside the array section and fill it exactly."""
    if (ends[0] | ends[1] | ends[2] | ends[3] | ends[4]) & 3 or not 0 <= ends[0] <= ends[1] <= ends[
        2
    ] <= ends[3] <= ends[4]:
        raise InvalidTrajectory("payload", f"array offsets {ends} must be non-decreasing multiples of 4")
    if ends[4] != section:
        raise InvalidTrajectory(
            "payload", f"the header's arrays end at byte {ends[4]}, the array section has {section} bytes"
        )


def check_lengths(ints: np.ndarray, n: int, ends: list[int], limits: CodecLimits) -> list[int]:
    """The trajectory lengths, checked against the header's count and the limits."""
    if ends[0] != 4 * n:
        raise InvalidTrajectory("trajectories", f"{ends[0] // 4} lengths for {n} trajectories")
    lens = ints[:n].tolist()
    if min(lens) < 0:
        raise InvalidTrajectory("trajectories", f"negative trajectory length {min(lens)}")
    if min(lens) == 0:
        raise InvalidTrajectory(
            f"trajectories[{lens.index(0)}].response_ids", "an empty completion (0 tokens)"
        )
    if max(lens) > limits.max_tokens_per_completion:
        i = lens.index(max(lens))
        raise InvalidTrajectory(
            f"trajectories[{i}].response_ids",
            f"{lens[i]} tokens exceeds max_tokens_per_completion={limits.max_tokens_per_completion}",
        )
    if (ends[1] - ends[0]) // 4 > limits.max_prompt_tokens:
        raise InvalidTrajectory(
            "prompt_ids",
            f"{(ends[1] - ends[0]) // 4} tokens exceeds max_prompt_tokens={limits.max_prompt_tokens}",
        )
    return lens


def check_counts(ends: list[int], lens: list[int], hv: list[bool]) -> None:
    """Token ids and log-probs hold every trajectory's tokens, versions those of the versioned ones."""
    tokens = sum(lens)
    for name, count in (
        ("response_ids", (ends[2] - ends[1]) // 4),
        ("behavior_logprobs", (ends[4] - ends[3]) // 4),
    ):
        if count != tokens:
            i = _first_short(lens, count)
            raise InvalidTrajectory(f"trajectories[{i}].{name}", f"{count} values for {tokens} tokens")
    versioned = [n if h else 0 for n, h in zip(lens, hv, strict=True)]
    count = (ends[3] - ends[2]) // 4
    if count != sum(versioned):
        i = _first_short(versioned, count)
        raise InvalidTrajectory(
            f"trajectories[{i}].versions", f"{count} versions for {sum(versioned)} tokens"
        )
