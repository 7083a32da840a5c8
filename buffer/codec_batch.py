"""Encode/decode whole batches of groups with one vectorised validation per batch (insert_many, sample).

The checks are `buffer/codec.py`'s, run once over a batch: the tokens, log-probs and prompts of every
group are concatenated and checked with a few numpy reductions, the per-group fields with plain type
tests. Anything unusual (a failed check, but also an ndarray subclass, a bool where a number is due,
an oversized payload) sends the batch to codec's exact per-group path, which names the field or accepts
what only looked unusual; so this module accepts a subset of what codec accepts and builds the same
groups. Decoded arrays are writable views into one buffer per batch and field: one copy per batch, no
per-group or per-trajectory copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import msgpack
import numpy as np

from buffer.codec import decode_group, encode_group
from buffer.config import CodecLimits
from buffer.errors import InvalidTrajectory
from buffer.types import SCHEMA_VERSION, SamplingParams, Trajectory, TrajectoryGroup

__all__ = ["decode_groups", "encode_groups"]

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_I32_MAX = 2**31 - 1
_NUM = frozenset((float, int))
_STR = frozenset((str,))
_ARRAY = frozenset((np.ndarray,))
_ONE = frozenset((1,))
_dtype, _ndim = attrgetter("dtype"), attrgetter("ndim")


def _sampling_ok(s: Sequence[Any]) -> bool:
    if len(s) != 4 or not set(map(type, s)) <= _NUM:
        return False
    temperature, top_p, _, max_tokens = s
    return math.isfinite(temperature) and temperature > 0 and 0 < top_p <= 1 and max_tokens >= 1


def _str_map(m: Any) -> bool:
    return type(m) is dict and (not m or (set(map(type, m)) <= _STR and set(map(type, m.values())) <= _STR))


def _priority_ok(p: Any) -> bool:
    return p is None or (type(p) in _NUM and math.isfinite(p) and p >= 0)


def _name(x: Any) -> bool:
    return type(x) is str and x != ""


def _arrays_ok(arrs: list, kinds: str) -> bool:
    """Plain 1-D ndarrays whose dtype kinds are in `kinds`."""
    return (
        set(map(type, arrs)) <= _ARRAY
        and set(map(_ndim, arrs)) <= _ONE
        and all(d.kind in kinds for d in set(map(_dtype, arrs)))
    )


def _ids_ok(a: np.ndarray) -> bool:
    """1-D integer token ids (or versions) in [0, 2^31)."""
    return a.ndim == 1 and a.dtype.kind in "iu" and (not len(a) or (a.min() >= 0 and a.max() <= _I32_MAX))


def _logprobs_ok(lp: np.ndarray) -> bool:
    """Finite and <= 0 (NaN fails both comparisons)."""
    return lp.ndim == 1 and (not len(lp) or (lp.max() <= 0 and lp.min() > -np.inf))


def _rewards_ok(rewards: list, reasons: list) -> bool:
    return set(map(type, rewards)) <= _NUM and math.isfinite(sum(rewards)) and set(map(type, reasons)) <= _STR


# --- encode


def _header_ok(g: TrajectoryGroup, limits: CodecLimits) -> bool:
    p, trs, s = g.prompt_ids, g.trajectories, g.sampling
    return (
        type(g.schema_version) is int
        and g.schema_version == SCHEMA_VERSION
        and _name(g.group_id)
        and _name(g.prompt_id)
        and _name(g.actor_id)
        and type(g.policy_version) is int
        and g.policy_version >= 0
        and type(g.created_at) in _NUM
        and math.isfinite(g.created_at)
        and type(p) is np.ndarray
        and p.ndim == 1
        and len(p) <= limits.max_prompt_tokens
        and type(trs) is list
        and 0 < len(trs) <= limits.max_completions_per_group
        and _priority_ok(g.priority)
        and type(s) is SamplingParams
        and _sampling_ok((s.temperature, s.top_p, s.top_k, s.max_tokens))
        and _str_map(g.metadata)
    )


def _versions_ok(trs: list[Trajectory]) -> bool:
    return all(
        t.versions is None
        or (
            type(t.versions) is np.ndarray
            and t.versions.ndim == 1
            and len(t.versions) == len(t.response_ids)
            and _ids_ok(t.versions)
        )
        for t in trs
    )


def _encode_fast(groups: Sequence[TrajectoryGroup], limits: CodecLimits) -> list[bytes] | None:
    """Every group of the batch encoded, or None when any check fails (the exact path then decides)."""
    trs: list[Trajectory] = []
    for g in groups:
        if not _header_ok(g, limits):
            return None
        trs += g.trajectories
    ids_l = [t.response_ids for t in trs]
    lp_l = [t.behavior_logprobs for t in trs]
    prompts_l = [g.prompt_ids for g in groups]
    rewards = [t.reward for t in trs]
    if not (
        _arrays_ok(ids_l, "iu")
        and _arrays_ok(prompts_l, "iu")
        and _arrays_ok(lp_l, "f")
        and _rewards_ok(rewards, [t.finish_reason for t in trs])
    ):
        return None
    lens = np.fromiter(map(len, ids_l), np.int64, len(ids_l))
    if lens.max() > limits.max_tokens_per_completion or lens.tolist() != list(map(len, lp_l)):
        return None
    ids, prompts = np.concatenate(ids_l), np.concatenate(prompts_l)
    lp = np.concatenate(lp_l).astype(_F32, copy=False)  # checked as stored, like codec
    if not (_ids_ok(ids) and _ids_ok(prompts) and _logprobs_ok(lp) and _versions_ok(trs)):
        return None
    ids, prompts = ids.astype(_I32, copy=False), prompts.astype(_I32, copy=False)
    return _pack_all(groups, lens, ids, lp, prompts, limits)


def _pack_all(groups, lens, ids, lp, prompts, limits: CodecLimits) -> list[bytes] | None:
    """One msgpack document per group over slices of the batch arrays (codec's wire format)."""
    lens32 = lens.astype(_I32)
    ends = [0, *np.cumsum(lens).tolist()]
    out: list[bytes] = []
    ti = pi = 0
    for g in groups:
        trs, s = g.trajectories, g.sampling
        tj, pj = ti + len(trs), pi + len(g.prompt_ids)
        doc = {
            "v": g.schema_version,
            "gid": g.group_id,
            "pid": g.prompt_id,
            "p": prompts[pi:pj].data,
            "pv": g.policy_version,
            "aid": g.actor_id,
            "t": float(g.created_at),
            "s": [float(s.temperature), float(s.top_p), int(s.top_k), int(s.max_tokens)],
            "tr": {
                "n": lens32[ti:tj].data,
                "ids": ids[ends[ti] : ends[tj]].data,
                "lp": lp[ends[ti] : ends[tj]].data,
                "rw": [float(t.reward) for t in trs],
                "fr": [t.finish_reason for t in trs],
                "ver": [None if t.versions is None else t.versions.astype(_I32).tobytes() for t in trs],
            },
            "m": dict(g.metadata),
            "pr": None if g.priority is None else float(g.priority),
        }
        data = msgpack.packb(doc, use_bin_type=True)
        if len(data) > limits.max_payload_bytes:
            return None
        out.append(data)
        ti, pi = tj, pj
    return out


def encode_groups(groups: Sequence[TrajectoryGroup], limits: CodecLimits) -> list[bytes | InvalidTrajectory]:
    """Validate and encode a batch: per group its bytes, or the `InvalidTrajectory` naming its field."""
    fast = _encode_fast(groups, limits) if groups else []
    if fast is not None:
        return list(fast)
    out: list[bytes | InvalidTrajectory] = []
    for g in groups:
        try:
            out.append(encode_group(g, limits))
        except InvalidTrajectory as e:
            out.append(e)
    return out


# --- decode


def _raw_ok(raw: Any) -> bool:
    return type(raw) is bytes and not len(raw) % 4


def _doc_ok(d: Any, limits: CodecLimits) -> bool:
    """Everything of one decoded document but the array values (checked over the batch)."""
    if type(d) is not dict or d.get("v") != SCHEMA_VERSION or type(d.get("v")) is not int:
        return False
    tr, p = d.get("tr"), d.get("p")
    if not (
        _name(d.get("gid"))
        and _name(d.get("pid"))
        and _name(d.get("aid"))
        and type(d.get("pv")) is int
        and d["pv"] >= 0
        and type(d.get("t")) in _NUM
        and math.isfinite(d["t"])
        and _raw_ok(p)
        and len(p) // 4 <= limits.max_prompt_tokens
        and type(d.get("s")) is list
        and _sampling_ok(d["s"])
        and _str_map(d.get("m"))
        and _priority_ok(d.get("pr"))
        and type(tr) is dict
        and _raw_ok(tr.get("n"))
        and _raw_ok(tr.get("ids"))
        and _raw_ok(tr.get("lp"))
    ):
        return False
    n = len(tr["n"]) // 4
    lists = (tr.get("rw"), tr.get("fr"), tr.get("ver"))
    return 0 < n <= limits.max_completions_per_group and all(type(x) is list and len(x) == n for x in lists)


def _unpack_all(payloads: Sequence[bytes], limits: CodecLimits) -> list[dict] | None:
    docs = []
    for data in payloads:
        if len(data) > limits.max_payload_bytes:
            return None
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException):
            return None
        if not _doc_ok(doc, limits):
            return None
        docs.append(doc)
    return docs


def _joined(raws: list[bytes], dtype: np.dtype) -> np.ndarray:
    """One writable array over the concatenated raw bytes (a single copy for the batch)."""
    return np.frombuffer(bytearray().join(raws), dtype)


def _versions(trs: list[dict]) -> list[np.ndarray | None] | None:
    out: list[np.ndarray | None] = []
    for tr in trs:
        for v in tr["ver"]:
            if v is None:
                out.append(None)
            elif _raw_ok(v):
                out.append(_joined([v], _I32))
            else:
                return None
    return out


def _decode_fast(payloads: Sequence[bytes], limits: CodecLimits) -> list[TrajectoryGroup] | None:
    """Every payload decoded and validated, or None when any check fails (the exact path then decides)."""
    docs = _unpack_all(payloads, limits)
    if docs is None:
        return None
    trs = [d["tr"] for d in docs]
    lens = np.frombuffer(b"".join([tr["n"] for tr in trs]), _I32)
    if lens.min() < 0 or lens.max() > limits.max_tokens_per_completion:
        return None
    counts = [len(tr["n"]) // 4 for tr in trs]
    starts = np.cumsum([0, *counts[:-1]])
    tokens = np.add.reduceat(lens, starts).tolist()  # every group has >= 1 trajectory
    if tokens != [len(tr["ids"]) // 4 for tr in trs] or tokens != [len(tr["lp"]) // 4 for tr in trs]:
        return None
    ids, lp = _joined([tr["ids"] for tr in trs], _I32), _joined([tr["lp"] for tr in trs], _F32)
    prompts = _joined([d["p"] for d in docs], _I32)
    rewards = [r for tr in trs for r in tr["rw"]]
    versions = _versions(trs)
    if not (
        (not len(ids) or ids.min() >= 0)
        and (not len(prompts) or prompts.min() >= 0)
        and _logprobs_ok(lp)
        and _rewards_ok(rewards, [f for tr in trs for f in tr["fr"]])
        and versions is not None
        and all(v is None or len(v) == n for v, n in zip(versions, lens.tolist(), strict=True))
        and all(v is None or _ids_ok(v) for v in versions)
    ):
        return None
    return _build(docs, lens.tolist(), ids, lp, prompts, versions)


def _build(docs, lens: list[int], ids, lp, prompts, versions) -> list[TrajectoryGroup]:
    """The groups, their arrays views into the batch arrays."""
    groups = []
    ti = tok = pi = 0
    for d in docs:
        tr = d["tr"]
        trajs = []
        for r, f in zip(tr["rw"], tr["fr"], strict=True):
            end = tok + lens[ti]
            trajs.append(Trajectory(ids[tok:end], lp[tok:end], float(r), f, versions[ti]))
            tok, ti = end, ti + 1
        pj = pi + len(d["p"]) // 4
        pr = d["pr"]
        groups.append(
            TrajectoryGroup(
                group_id=d["gid"],
                prompt_id=d["pid"],
                prompt_ids=prompts[pi:pj],
                policy_version=d["pv"],
                actor_id=d["aid"],
                created_at=float(d["t"]),
                sampling=SamplingParams(*d["s"]),
                trajectories=trajs,
                metadata=d["m"],
                priority=None if pr is None else float(pr),
                schema_version=d["v"],
            )
        )
        pi = pj
    return groups


def decode_groups(payloads: Sequence[bytes], limits: CodecLimits) -> list[TrajectoryGroup]:
    """Decode and validate a batch; the first invalid payload raises `InvalidTrajectory` naming the field."""
    fast = _decode_fast(payloads, limits) if payloads else []
    if fast is not None:
        return fast
    return [decode_group(p, limits) for p in payloads]
