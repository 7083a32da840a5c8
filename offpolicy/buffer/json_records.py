"""A `TrajectoryGroup` as plain JSON, for producers that post groups over HTTP (`POST /v1/groups`).

    {"group_id": "...", "prompt_id": "...", "prompt_ids": [int], "policy_version": int, "actor_id": "...",
     "created_at": float, "sampling": {"temperature", "top_p", "top_k", "max_tokens"},
     "metadata": {str: str}, "priority": float | null, "num_experts": int | null,
     "trajectories": [{"response_ids": [int], "behavior_logprobs": [float], "reward": float,
                       "finish_reason": str, "versions": [int] | null, "policy_mask": [bool] | null,
                       "routed_experts": [[[int]]] | null}]}

`group_id` defaults to a fresh uuid4 hex, `created_at` to now, `sampling` fields, `metadata`, `priority`,
`versions`, `policy_mask`, `routed_experts` and `num_experts` to the record's defaults. A document of the
wrong shape raises `InvalidTrajectory` naming the field; the values are checked by the codec when the group
is inserted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup

_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens")


def group_from_json(doc: Any) -> TrajectoryGroup:
    """The group a JSON document describes (arrays converted, not yet validated by the codec)."""
    if not isinstance(doc, dict):
        raise InvalidTrajectory("payload", "a group must be a JSON object")
    trajs = doc.get("trajectories")
    if not isinstance(trajs, list) or not trajs:
        raise InvalidTrajectory("trajectories", "must be a non-empty list")
    sampling = doc.get("sampling", {})
    if not isinstance(sampling, dict) or set(sampling) - set(_SAMPLING):
        raise InvalidTrajectory("sampling", f"must be an object with keys among {list(_SAMPLING)}")
    return TrajectoryGroup(
        group_id=doc.get("group_id") or uuid.uuid4().hex,
        prompt_id=doc.get("prompt_id"),
        prompt_ids=_array(doc.get("prompt_ids"), np.int64, "prompt_ids"),
        policy_version=_int(doc.get("policy_version"), "policy_version"),
        actor_id=doc.get("actor_id"),
        created_at=_float(doc.get("created_at", time.time()), "created_at"),
        sampling=SamplingParams(**sampling),
        trajectories=[_trajectory(t, i) for i, t in enumerate(trajs)],
        metadata=doc.get("metadata", {}),
        priority=None if doc.get("priority") is None else _float(doc["priority"], "priority"),
        num_experts=doc.get("num_experts"),
    )


def group_to_json(g: TrajectoryGroup) -> dict[str, Any]:
    """`group_from_json`'s inverse."""
    s = g.sampling
    return {
        "group_id": g.group_id,
        "prompt_id": g.prompt_id,
        "prompt_ids": np.asarray(g.prompt_ids).tolist(),
        "policy_version": g.policy_version,
        "actor_id": g.actor_id,
        "created_at": g.created_at,
        "sampling": {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "max_tokens": s.max_tokens,
        },
        "metadata": dict(g.metadata),
        "priority": g.priority,
        "num_experts": g.num_experts,
        "trajectories": [
            {
                "response_ids": np.asarray(t.response_ids).tolist(),
                "behavior_logprobs": np.asarray(t.behavior_logprobs).tolist(),
                "reward": t.reward,
                "finish_reason": t.finish_reason,
                "versions": None if t.versions is None else np.asarray(t.versions).tolist(),
                "policy_mask": None if t.policy_mask is None else np.asarray(t.policy_mask).tolist(),
                "routed_experts": None if t.routed_experts is None else np.asarray(t.routed_experts).tolist(),
            }
            for t in g.trajectories
        ],
    }


def _trajectory(doc: Any, i: int) -> Trajectory:
    pre = f"trajectories[{i}]"
    if not isinstance(doc, dict):
        raise InvalidTrajectory(pre, "must be a JSON object")
    versions, mask = doc.get("versions"), doc.get("policy_mask")
    return Trajectory(
        response_ids=_array(doc.get("response_ids"), np.int64, f"{pre}.response_ids"),
        behavior_logprobs=_array(doc.get("behavior_logprobs"), np.float64, f"{pre}.behavior_logprobs"),
        reward=_float(doc.get("reward"), f"{pre}.reward"),
        finish_reason=doc.get("finish_reason", "stop"),
        versions=None if versions is None else _array(versions, np.int64, f"{pre}.versions"),
        policy_mask=None if mask is None else _array(mask, np.bool_, f"{pre}.policy_mask"),
        routed_experts=_routed(doc.get("routed_experts"), f"{pre}.routed_experts"),
    )


def _routed(values: Any, field: str) -> np.ndarray | None:
    """Nested JSON lists of integers [tokens][layers][top_k] as an int64 array (the codec checks the rest)."""
    if values is None:
        return None
    try:
        a = np.asarray(values)
    except ValueError as exc:  # ragged
        raise InvalidTrajectory(field, "must be [tokens][layers][top_k] lists of integers") from exc
    if a.ndim != 3 or a.dtype.kind not in "iu":
        raise InvalidTrajectory(field, "must be [tokens][layers][top_k] lists of integers")
    return a.astype(np.int64, copy=False)


def _float(value: Any, field: str) -> float:
    """A JSON number as a float (a bool or an integer too large for a float names `field`)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidTrajectory(field, f"must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError as exc:
        raise InvalidTrajectory(field, "out of range") from exc


def _int(value: Any, field: str) -> int:
    """A JSON integer in [0, 2^63) (what the frame's header holds)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise InvalidTrajectory(field, f"must be an integer in [0, 2^63), got {value!r}"[:200])
    return value


def _array(values: Any, dtype: type, field: str) -> np.ndarray:
    """A JSON list of numbers (or booleans, for a mask) as a 1-D array; anything else names `field`."""
    kinds = (bool,) if dtype is np.bool_ else (int, float)
    if not isinstance(values, list) or not all(
        isinstance(v, kinds) and (dtype is np.bool_ or not isinstance(v, bool)) for v in values
    ):
        raise InvalidTrajectory(field, f"must be a list of {'booleans' if dtype is np.bool_ else 'numbers'}")
    if dtype is np.int64 and not all(isinstance(v, int) for v in values):
        raise InvalidTrajectory(field, "must be a list of integers")
    try:
        return np.asarray(values, dtype=dtype)
    except OverflowError as exc:
        raise InvalidTrajectory(field, f"a value is out of range: {exc}") from exc
