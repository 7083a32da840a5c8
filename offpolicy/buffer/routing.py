"""Routed experts (MoE) in a record and in a frame: their checks, and the frame's header entry and array.

A group's trajectories may carry `routed_experts` (buffer/types.py: integers [R, L, K], one row per response
token) with the group's `num_experts`. The contract, checked on a `TrajectoryGroup` (`check_group`) and on a
decoded frame (`frame_routing`), raising `InvalidTrajectory` naming the field:

- `num_experts` an int in [1, `MAX_EXPERTS`] wherever a trajectory has routing;
- each array an integer array of ndim 3 whose first dimension is the trajectory's response length, the same
  (L, K) across the group, K <= num_experts, every value in [0, num_experts).

On the wire (schema 5, buffer/codec.py) the header's `routed_experts` entry is `{"num_experts": E,
"layers": L, "top_k": K, "has": [bool] * n}` and the routed trajectories' arrays follow the log-probs,
concatenated in order, C order, dtype `routed_dtype(E)` (uint8 up to 256 experts, else little-endian
uint16): `L * K` bytes per response token with uint8. Frames of schema < 5 have none.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.types import MAX_EXPERTS, TrajectoryGroup, routed_dtype

__all__ = ["check_group", "frame_routing", "header_entry", "routed_arrays"]

KEY = "routed_experts"  # the frame header's key


def _num_experts(e: Any) -> int:
    if type(e) is not int or not 1 <= e <= MAX_EXPERTS:
        raise InvalidTrajectory(
            "num_experts", f"must be an int in [1, {MAX_EXPERTS}] with routing, got {e!r}"
        )
    return e


def check_group(group: TrajectoryGroup) -> None:
    """The routed experts of a group object (`validate_group`'s path): types, shapes, values."""
    routed = [(i, t) for i, t in enumerate(group.trajectories) if t.routed_experts is not None]
    if not routed:
        return
    e = _num_experts(group.num_experts)
    shape = None
    for i, t in routed:
        a, name = t.routed_experts, f"trajectories[{i}].routed_experts"
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or a.ndim != 3:
            got = f"{a.dtype}, ndim {a.ndim}" if isinstance(a, np.ndarray) else type(a).__name__
            raise InvalidTrajectory(name, f"must be an integer array [tokens, layers, top_k], got {got}")
        if a.shape[0] != len(t.response_ids):
            raise InvalidTrajectory(name, f"{a.shape[0]} rows for {len(t.response_ids)} response tokens")
        if shape is None:
            shape = a.shape[1:]
            if min(shape) < 1 or shape[1] > e:
                raise InvalidTrajectory(name, f"(layers, top_k) {shape} must be >= 1 with top_k <= {e}")
        elif a.shape[1:] != shape:
            raise InvalidTrajectory(name, f"(layers, top_k) {a.shape[1:]} != the group's {shape}")
        if a.size and (a.min() < 0 or a.max() >= e):
            raise InvalidTrajectory(name, f"experts must be in [0, {e}), got min {a.min()}, max {a.max()}")


def routed_arrays(group: TrajectoryGroup) -> list[np.ndarray]:
    """The routed trajectories' arrays as the frame holds them (compact dtype, C order; copies only where
    the dtype or layout differs). The group passed `check_group`."""
    trs = [t for t in group.trajectories if t.routed_experts is not None]
    if not trs:
        return []
    dtype = routed_dtype(group.num_experts)  # type: ignore[arg-type]
    return [np.ascontiguousarray(t.routed_experts, dtype) for t in trs]


def header_entry(group: TrajectoryGroup, arrays: list[np.ndarray]) -> dict | None:
    """The frame header's `routed_experts` entry of a checked group (None without routing)."""
    if not arrays:
        return None
    _, layers, top_k = arrays[0].shape
    has = [t.routed_experts is not None for t in group.trajectories]
    return {"num_experts": group.num_experts, "layers": layers, "top_k": top_k, "has": has}


def frame_routing(
    doc: dict, lens: list[int], data: bytes, start: int, section_end: int
) -> tuple[np.ndarray | None, int]:
    """A schema-5 frame's routed experts: (a view of shape [tokens, L, K] over the routed trajectories'
    tokens, or None; the number of experts, or 0), checked: the header entry, the byte count (the array
    runs from `start` to `section_end`, the end of the frame) and the values."""
    entry = doc.get(KEY)
    if entry is None:
        if section_end != start:
            raise InvalidTrajectory("payload", f"{section_end - start} bytes after the log-probs")
        return None, 0
    if type(entry) is not dict:
        raise InvalidTrajectory(KEY, "the header entry must be a map")
    e = _num_experts(entry.get("num_experts"))
    layers, top_k, has = entry.get("layers"), entry.get("top_k"), entry.get("has")
    if type(layers) is not int or type(top_k) is not int or not (layers >= 1 and 1 <= top_k <= e):
        raise InvalidTrajectory(KEY, f"layers {layers!r}, top_k {top_k!r} must be ints >= 1, top_k <= {e}")
    if type(has) is not list or len(has) != len(lens) or not all(type(h) is bool for h in has):
        raise InvalidTrajectory(KEY, f"`has` must be a list of {len(lens)} bools")
    dtype = routed_dtype(e)
    tokens = sum(n for n, h in zip(lens, has, strict=True) if h)
    count = tokens * layers * top_k
    if section_end - start != count * dtype.itemsize:
        raise InvalidTrajectory(
            KEY, f"{section_end - start} bytes for {tokens} tokens x {layers} x {top_k} of {dtype.name}"
        )
    view = np.frombuffer(data, dtype, count, start).reshape(tokens, layers, top_k)  # (T, L, K)
    if count and view.max() >= e:
        ends = np.cumsum([n for n, h in zip(lens, has, strict=True) if h])
        row = int(np.argmax((view >= e).any(axis=(1, 2))))
        i = [j for j, h in enumerate(has) if h][int(np.searchsorted(ends, row, side="right"))]
        raise InvalidTrajectory(f"trajectories[{i}].{KEY}", f"experts must be in [0, {e}), got {view.max()}")
    return view, e


def split(view: np.ndarray | None, lens: list[int], has: list[bool] | None) -> list[np.ndarray | None]:
    """Each trajectory's rows of a frame's routed view, or None where it has none."""
    if view is None or has is None:
        return [None] * len(lens)
    out, a = [], 0
    for n, h in zip(lens, has, strict=True):
        out.append(view[a : a + n] if h else None)
        a += n if h else 0
    return out
