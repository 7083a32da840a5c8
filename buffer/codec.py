"""Encode/decode `TrajectoryGroup` as versioned msgpack (arrays as raw little-endian bytes), validating.

Wire format (schema_version 1): one msgpack map
`{"v": 1, "gid", "pid", "p": <int32 LE bytes>, "pv", "aid", "t", "s": [temperature, top_p, top_k,
max_tokens], "tr": [[<ids int32 LE>, <logprobs float32 LE>, reward, finish_reason, <versions int32 LE>
| nil], ...], "m": {str: str}, "pr": priority | nil}`. Never pickle.
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


def _check_traj(t: Trajectory, i: int, limits: CodecLimits) -> None:
    pre = f"trajectories[{i}]"
    ids = _check_ids(t.response_ids, f"{pre}.response_ids", limits.max_tokens_per_completion,
                     "max_tokens_per_completion")  # fmt: skip
    lp = t.behavior_logprobs
    if not isinstance(lp, np.ndarray) or lp.ndim != 1 or lp.dtype.kind != "f":
        raise InvalidTrajectory(f"{pre}.behavior_logprobs", "must be a 1-D float array")
    if len(lp) != len(ids):
        raise InvalidTrajectory(
            f"{pre}.behavior_logprobs", f"length {len(lp)} != len(response_ids) {len(ids)}"
        )
    lp32 = lp.astype(np.float32, copy=False)
    if not np.isfinite(lp32).all():
        raise InvalidTrajectory(f"{pre}.behavior_logprobs", "contains a non-finite value")
    if (lp32 > 0).any():
        raise InvalidTrajectory(f"{pre}.behavior_logprobs", f"log-probs must be <= 0, max is {lp32.max()}")
    if t.versions is not None:
        v = t.versions
        if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype.kind not in "iu" or len(v) != len(ids):
            raise InvalidTrajectory(f"{pre}.versions", f"must be a 1-D integer array of length {len(ids)}")
        if len(v) and (v.min() < 0 or v.max() > _I32_MAX):
            raise InvalidTrajectory(f"{pre}.versions", "versions must be in [0, 2^31)")
    if not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
        raise InvalidTrajectory(f"{pre}.reward", f"must be a finite number, got {t.reward!r}")
    if not isinstance(t.finish_reason, str):
        raise InvalidTrajectory(f"{pre}.finish_reason", "must be a string")


def validate_group(group: TrajectoryGroup, limits: CodecLimits = _DEFAULT_LIMITS) -> None:
    """Raise `InvalidTrajectory(field, message)` for the first field of `group` that breaks the contract."""
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
    for i, t in enumerate(group.trajectories):
        _check_traj(t, i, limits)
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
    s = group.sampling
    doc = {
        "v": group.schema_version,
        "gid": group.group_id,
        "pid": group.prompt_id,
        "p": _raw(group.prompt_ids, _I32),
        "pv": group.policy_version,
        "aid": group.actor_id,
        "t": float(group.created_at),
        "s": [float(s.temperature), float(s.top_p), int(s.top_k), int(s.max_tokens)],
        "tr": [
            [
                _raw(t.response_ids, _I32),
                _raw(t.behavior_logprobs, _F32),
                float(t.reward),
                t.finish_reason,
                None if t.versions is None else _raw(t.versions, _I32),
            ]
            for t in group.trajectories
        ],
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


def _decode_traj(item: Any, i: int) -> Trajectory:
    pre = f"trajectories[{i}]"
    if not isinstance(item, list) or len(item) != 5:
        raise InvalidTrajectory(pre, "must be a 5-element array")
    raw_ids, raw_lp, reward, finish, raw_v = item
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        raise InvalidTrajectory(f"{pre}.reward", f"wrong type {type(reward).__name__}")
    return Trajectory(
        response_ids=_array(raw_ids, _I32, f"{pre}.response_ids"),
        behavior_logprobs=_array(raw_lp, _F32, f"{pre}.behavior_logprobs"),
        reward=float(reward),
        finish_reason=finish,
        versions=None if raw_v is None else _array(raw_v, _I32, f"{pre}.versions"),
    )


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
    trs = _get(doc, "tr", "trajectories", list)
    if len(trs) > limits.max_completions_per_group:  # before decoding a huge list of arrays
        raise InvalidTrajectory(
            "trajectories", f"{len(trs)} exceeds max_completions_per_group={limits.max_completions_per_group}"
        )
    priority = doc.get("pr")
    group = TrajectoryGroup(
        group_id=_get(doc, "gid", "group_id", str),
        prompt_id=_get(doc, "pid", "prompt_id", str),
        prompt_ids=_array(_get(doc, "p", "prompt_ids", bytes), _I32, "prompt_ids"),
        policy_version=_get(doc, "pv", "policy_version", int),
        actor_id=_get(doc, "aid", "actor_id", str),
        created_at=float(_get(doc, "t", "created_at", (int, float))),
        sampling=SamplingParams(*s),
        trajectories=[_decode_traj(item, i) for i, item in enumerate(trs)],
        metadata=_get(doc, "m", "metadata", dict),
        priority=None if priority is None else float(priority),
        schema_version=version,
    )
    validate_group(group, limits)
    return group
