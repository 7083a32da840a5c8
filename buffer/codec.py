"""Encode/decode `TrajectoryGroup` as versioned msgpack (arrays as raw little-endian bytes), validating.

Wire format (schema_version 1): one msgpack map
`{"v": 1, "gid", "pid", "p": <int32 LE bytes>, "pv", "aid", "t", "s": [temperature, top_p, top_k,
max_tokens], "tr": {"n": <int32 LE length of each trajectory>, "ids": <int32 LE, all trajectories
concatenated>, "lp": <float32 LE, concatenated>, "rw": [reward, ...], "fr": [finish_reason, ...],
"ver": [<int32 LE versions> | nil, ...]}, "m": {str: str}, "pr": priority | nil}`. The concatenated
arrays make validation a handful of vectorised checks per group instead of several per trajectory.
Never pickle.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from buffer.config import CodecLimits
from buffer.errors import InvalidTrajectory
from buffer.types import SCHEMA_VERSION, SamplingParams, Trajectory, TrajectoryGroup

__all__ = ["CodecLimits", "decode_group", "encode_group", "validate_group"]

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_DEFAULT_LIMITS = CodecLimits()


# --- validation (shared by encode and decode)


def _check_ids(a: Any, name: str, limit: int, limit_name: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
        raise InvalidTrajectory(name, f"must be a 1-D integer array, got {type(a).__name__}")
    if len(a) > limit:
        raise InvalidTrajectory(name, f"{len(a)} tokens exceeds {limit_name}={limit}")
    if len(a) and (a.min() < 0 or a.max() > _I32_MAX):
        raise InvalidTrajectory(name, f"token ids must be in [0, 2^31), got min {a.min()}, max {a.max()}")
    return a


def _check_traj(t: Trajectory, i: int) -> None:
    """Types and lengths of one trajectory (values are checked over the whole group at once)."""
    pre = f"trajectories[{i}]"
    ids, lp = t.response_ids, t.behavior_logprobs
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidTrajectory(
            f"{pre}.response_ids", f"must be a 1-D integer array, got {type(ids).__name__}"
        )
    if not isinstance(lp, np.ndarray) or lp.ndim != 1 or lp.dtype.kind != "f":
        raise InvalidTrajectory(f"{pre}.behavior_logprobs", "must be a 1-D float array")
    if len(lp) != len(ids):
        raise InvalidTrajectory(
            f"{pre}.behavior_logprobs", f"length {len(lp)} != len(response_ids) {len(ids)}"
        )
    v = t.versions
    if v is not None:
        if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype.kind not in "iu" or len(v) != len(ids):
            raise InvalidTrajectory(f"{pre}.versions", f"must be a 1-D integer array of length {len(ids)}")
        if len(v) and (v.min() < 0 or v.max() > _I32_MAX):
            raise InvalidTrajectory(f"{pre}.versions", "versions must be in [0, 2^31)")
    if not isinstance(t.reward, int | float) or isinstance(t.reward, bool) or not math.isfinite(t.reward):
        raise InvalidTrajectory(f"{pre}.reward", f"must be a finite number, got {t.reward!r}")
    if not isinstance(t.finish_reason, str):
        raise InvalidTrajectory(f"{pre}.finish_reason", "must be a string")


def _check_values(lens: np.ndarray, ids: np.ndarray, lp: np.ndarray, limits: CodecLimits) -> None:
    """Value checks over all trajectories' concatenated tokens and log-probs, naming the trajectory."""
    ends = np.cumsum(lens)

    def where(pos: int) -> str:
        return f"trajectories[{int(np.searchsorted(ends, pos, side='right'))}]"

    if len(lens) and lens.max() > limits.max_tokens_per_completion:
        i = int(lens.argmax())
        raise InvalidTrajectory(
            f"trajectories[{i}].response_ids",
            f"{lens[i]} tokens exceeds max_tokens_per_completion={limits.max_tokens_per_completion}",
        )
    if len(ids) and (ids.min() < 0 or ids.max() > _I32_MAX):
        pos = int(np.argmax((ids < 0) | (ids > _I32_MAX)))
        raise InvalidTrajectory(
            f"{where(pos)}.response_ids", f"token ids must be in [0, 2^31), got {ids[pos]}"
        )
    ok = lp <= 0  # False for nan too
    if not ok.all() or not np.isfinite(lp).all():
        pos = int(np.argmax(~(ok & np.isfinite(lp))))
        what = (
            "contains a non-finite value"
            if not np.isfinite(lp[pos])
            else f"log-probs must be <= 0, got {lp[pos]}"
        )
        raise InvalidTrajectory(f"{where(pos)}.behavior_logprobs", what)


def validate_group(group: TrajectoryGroup, limits: CodecLimits = _DEFAULT_LIMITS) -> None:
    """Raise `InvalidTrajectory(field, message)` for the first field of `group` that breaks the contract."""
    _check_header(group, limits)
    for i, t in enumerate(group.trajectories):
        _check_traj(t, i)
    lens, ids, lp = _concat(group.trajectories)
    _check_values(lens, ids, lp, limits)
    _check_rest(group)


def _check_header(group: TrajectoryGroup, limits: CodecLimits) -> None:
    """Identity, version, time, prompt and trajectory count."""
    if group.schema_version != SCHEMA_VERSION:
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


def _concat(trajs: list[Trajectory]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lens = np.array([len(t.response_ids) for t in trajs], dtype=np.int64)
    ids = np.concatenate([t.response_ids for t in trajs]) if trajs else np.zeros(0, np.int64)
    lp = np.concatenate([t.behavior_logprobs for t in trajs]).astype(np.float32, copy=False)
    return lens, ids, lp


def _check_rest(group: TrajectoryGroup) -> None:
    """The group-level fields after the trajectories: priority, metadata, sampling."""
    if group.priority is not None and (not math.isfinite(group.priority) or group.priority < 0):
        raise InvalidTrajectory("priority", f"must be finite and >= 0, got {group.priority!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in group.metadata.items()):
        raise InvalidTrajectory("metadata", "must map str to str")
    s = group.sampling
    nums = (s.temperature, s.top_p, s.top_k, s.max_tokens)
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in nums):
        raise InvalidTrajectory("sampling", f"must be numbers, got {s}")
    if not (math.isfinite(s.temperature) and s.temperature > 0 and 0 < s.top_p <= 1 and s.max_tokens >= 1):
        raise InvalidTrajectory("sampling", f"invalid sampling parameters {s}")


# --- encode


def _raw(a: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def encode_group(group: TrajectoryGroup, limits: CodecLimits = _DEFAULT_LIMITS) -> bytes:
    """Validate `group` and encode it to msgpack bytes (raises `InvalidTrajectory`)."""
    validate_group(group, limits)
    lens, ids, lp = _concat(group.trajectories)
    s = group.sampling
    trs = group.trajectories
    doc = {
        "v": group.schema_version,
        "gid": group.group_id,
        "pid": group.prompt_id,
        "p": _raw(group.prompt_ids, _I32),
        "pv": group.policy_version,
        "aid": group.actor_id,
        "t": float(group.created_at),
        "s": [float(s.temperature), float(s.top_p), int(s.top_k), int(s.max_tokens)],
        "tr": {
            "n": _raw(lens, _I32),
            "ids": _raw(ids, _I32),
            "lp": _raw(lp, _F32),
            "rw": [float(t.reward) for t in trs],
            "fr": [t.finish_reason for t in trs],
            "ver": [None if t.versions is None else _raw(t.versions, _I32) for t in trs],
        },
        "m": dict(group.metadata),
        "pr": None if group.priority is None else float(group.priority),
    }
    data = msgpack.packb(doc, use_bin_type=True)
    if len(data) > limits.max_payload_bytes:
        raise InvalidTrajectory(
            "payload", f"{len(data)} bytes exceeds max_payload_bytes={limits.max_payload_bytes}"
        )
    return data


# --- decode


def _get(doc: dict, key: str, field: str, types: type | tuple[type, ...]) -> Any:
    if key not in doc:
        raise InvalidTrajectory(field, "missing")
    value = doc[key]
    if not isinstance(value, types) or isinstance(value, bool):
        raise InvalidTrajectory(field, f"wrong type {type(value).__name__}")
    return value


def _array(raw: Any, dtype: np.dtype, field: str) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) % dtype.itemsize:
        raise InvalidTrajectory(field, f"must be raw {dtype} bytes (a multiple of {dtype.itemsize} bytes)")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))


def _decode_trajs(tr: Any, limits: CodecLimits) -> list[Trajectory]:
    """Decode the concatenated trajectory arrays, check their values at once, and split them (views)."""
    if not isinstance(tr, dict):
        raise InvalidTrajectory("trajectories", "must be a map of concatenated arrays")
    lens = _array(tr.get("n"), _I32, "trajectories")
    n = len(lens)
    if n == 0:
        raise InvalidTrajectory("trajectories", "a group needs at least one trajectory")
    if n > limits.max_completions_per_group:
        raise InvalidTrajectory(
            "trajectories", f"{n} exceeds max_completions_per_group={limits.max_completions_per_group}"
        )
    if lens.min() < 0:
        raise InvalidTrajectory("trajectories", "negative trajectory length")
    ids = _array(tr.get("ids"), _I32, "trajectories.response_ids")
    lp = _array(tr.get("lp"), _F32, "trajectories.behavior_logprobs")
    ends = np.cumsum(lens)
    for name, arr in (("response_ids", ids), ("behavior_logprobs", lp)):
        if len(arr) != ends[-1]:
            i = min(int(np.searchsorted(ends, len(arr), side="right")), n - 1)
            raise InvalidTrajectory(f"trajectories[{i}].{name}", f"{len(arr)} values for {ends[-1]} tokens")
    _check_values(lens, ids, lp, limits)
    rw, fr, ver = tr.get("rw"), tr.get("fr"), tr.get("ver")
    for name, lst in (("reward", rw), ("finish_reason", fr), ("versions", ver)):
        if not isinstance(lst, list) or len(lst) != n:
            raise InvalidTrajectory(f"trajectories.{name}", f"must be a list of {n}")
    for i, r in enumerate(rw):
        if not isinstance(r, int | float) or isinstance(r, bool):
            raise InvalidTrajectory(f"trajectories[{i}].reward", f"wrong type {type(r).__name__}")
    id_parts, lp_parts = np.split(ids, ends[:-1]), np.split(lp, ends[:-1])
    return [
        Trajectory(
            response_ids=id_parts[i],
            behavior_logprobs=lp_parts[i],
            reward=float(rw[i]),
            finish_reason=fr[i],
            versions=None if ver[i] is None else _array(ver[i], _I32, f"trajectories[{i}].versions"),
        )
        for i in range(n)
    ]


def decode_group(data: bytes, limits: CodecLimits = _DEFAULT_LIMITS) -> TrajectoryGroup:
    """Decode and validate one group; any problem raises `InvalidTrajectory` naming the field."""
    if len(data) > limits.max_payload_bytes:
        raise InvalidTrajectory(
            "payload", f"{len(data)} bytes exceeds max_payload_bytes={limits.max_payload_bytes}"
        )
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise InvalidTrajectory("payload", f"not valid msgpack: {e}") from e
    if not isinstance(doc, dict):
        raise InvalidTrajectory("payload", "must be a msgpack map")
    version = doc.get("v")
    if version != SCHEMA_VERSION:
        raise InvalidTrajectory("schema_version", f"unknown schema version {version!r}")
    s = _get(doc, "s", "sampling", list)
    if len(s) != 4:
        raise InvalidTrajectory("sampling", "must be [temperature, top_p, top_k, max_tokens]")
    priority = doc.get("pr")
    group = TrajectoryGroup(
        group_id=_get(doc, "gid", "group_id", str),
        prompt_id=_get(doc, "pid", "prompt_id", str),
        prompt_ids=_array(_get(doc, "p", "prompt_ids", bytes), _I32, "prompt_ids"),
        policy_version=_get(doc, "pv", "policy_version", int),
        actor_id=_get(doc, "aid", "actor_id", str),
        created_at=float(_get(doc, "t", "created_at", (int, float))),
        sampling=SamplingParams(*s),
        trajectories=_decode_trajs(doc.get("tr"), limits),
        metadata=_get(doc, "m", "metadata", dict),
        priority=None if priority is None else float(priority),
        schema_version=version,
    )
    _check_header(group, limits)
    for i, t in enumerate(group.trajectories):
        _check_traj(t, i)
    _check_rest(group)
    return group
