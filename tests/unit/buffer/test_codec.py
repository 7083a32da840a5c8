"""Codec: round trip (property test), the frame's layout, and every rejection on the way in (`validate_group`,
`encode_group`); the rejections of bytes from the wire (`decode_group`) are test_codec_decode.py."""

from __future__ import annotations

import dataclasses
import itertools
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.buffer.codec import SHORT_KEYS, CodecLimits, decode_group, encode_group, validate_group
from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from tests.conftest import build_group

_ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)
_response_ids = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)  # a completion has >= 1 token
_text = st.text(max_size=12)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    ids = np.array(draw(_response_ids), dtype=np.int32)
    lps = draw(
        st.lists(
            st.floats(-1e30, 0.0, allow_nan=False, allow_infinity=False).map(
                lambda x: max(float(np.float32(x)), -3e38)
            ),
            min_size=len(ids),
            max_size=len(ids),
        )
    )
    versions = draw(st.none() | st.just(np.arange(len(ids), dtype=np.int32)))
    reward = draw(st.floats(allow_nan=False, allow_infinity=False))
    flags = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    mask = draw(st.none() | st.just(np.array(flags, dtype=bool))) if any(flags) else None
    return Trajectory(ids, np.array(lps, dtype=np.float32), reward, draw(_text), versions, mask)


@st.composite
def groups(draw: st.DrawFn) -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id=draw(st.text(min_size=1, max_size=32)),
        prompt_id=draw(st.text(min_size=1, max_size=8)),
        prompt_ids=np.array(draw(_ids), dtype=np.int32),
        policy_version=draw(st.integers(0, 2**40)),
        actor_id=draw(st.text(min_size=1, max_size=8)),
        created_at=draw(st.floats(0, 2e9)),
        sampling=SamplingParams(
            temperature=draw(st.floats(0.01, 5.0)),
            top_p=draw(st.floats(0.01, 1.0)),
            top_k=draw(st.integers(-1, 100)),
            max_tokens=draw(st.integers(1, 4096)),
        ),
        trajectories=draw(st.lists(trajectories(), min_size=1, max_size=5)),
        metadata=draw(st.dictionaries(_text, _text, max_size=3)),
        priority=draw(st.none() | st.floats(0, 1e6)),
    )


def _assert_same(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    for f in ("group_id", "prompt_id", "policy_version", "actor_id", "created_at", "sampling", "metadata"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.priority == b.priority and a.schema_version == b.schema_version
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        assert y.response_ids.dtype == np.int32 and y.behavior_logprobs.dtype == np.float32
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_array_equal(x.behavior_logprobs, y.behavior_logprobs)
        assert (x.reward, x.finish_reason) == (y.reward, y.finish_reason)
        assert (x.versions is None) == (y.versions is None)
        if x.versions is not None:
            np.testing.assert_array_equal(x.versions, y.versions)
        full = np.ones(len(x.response_ids), dtype=bool)  # an all-policy mask travels as none
        mx = x.policy_mask if x.policy_mask is not None else full
        np.testing.assert_array_equal(mx, y.policy_mask if y.policy_mask is not None else full)


@settings(max_examples=150, deadline=None)
@given(groups())
def test_round_trip(group: TrajectoryGroup) -> None:
    _assert_same(group, decode_group(encode_group(group)))


def test_frame_layout_is_prefix_header_then_aligned_raw_little_endian_arrays() -> None:
    g = build_group(n=2, tokens=3)
    g.trajectories[1].versions = np.array([4, 5, 6], np.int32)
    data = encode_group(g)
    assert data[:4] == b"OPTG" and struct.unpack_from("<HI", data, 4)[0] == 4
    head, arrays = _split(data)
    assert set(head) == {
        "group_id", "prompt_id", "policy_version", "actor_id", "created_at", "sampling", "metadata",
        "priority", "reward", "finish_reason", "has_versions", "env_spans", "array_ends",
    }  # fmt: skip
    assert head["env_spans"] == [[], []]
    assert head["has_versions"] == [False, True] and head["reward"] == [t.reward for t in g.trajectories]
    assert arrays["lens"] == np.array([3, 3], "<i4").tobytes()
    assert arrays["prompt"] == g.prompt_ids.astype("<i4").tobytes()
    assert arrays["ids"] == b"".join(t.response_ids.astype("<i4").tobytes() for t in g.trajectories)
    assert arrays["ver"] == np.array([4, 5, 6], "<i4").tobytes()
    assert arrays["lp"] == b"".join(t.behavior_logprobs.astype("<f4").tobytes() for t in g.trajectories)
    assert _frame(head, arrays) == data  # the hand-built frame is byte for byte the codec's


def test_decoded_arrays_are_read_only_views_into_the_payload() -> None:
    data = encode_group(build_group(n=2, tokens=4))
    out = decode_group(data)
    arrays = [out.prompt_ids, *(a for t in out.trajectories for a in (t.response_ids, t.behavior_logprobs))]
    for a in arrays:
        assert not a.flags.writeable
        assert np.shares_memory(a, np.frombuffer(data, np.uint8))


def test_accepts_other_int_and_float_dtypes() -> None:
    g = build_group(n=1, tokens=4)
    t = g.trajectories[0]
    t.response_ids = t.response_ids.astype(np.int64)
    t.behavior_logprobs = t.behavior_logprobs.astype(np.float64)
    out = decode_group(encode_group(g))
    assert out.trajectories[0].response_ids.dtype == np.int32
    np.testing.assert_array_equal(out.trajectories[0].response_ids, t.response_ids)


# --- rejections on the way in (validate_group / encode_group)


def _traj(g: TrajectoryGroup, **changes) -> TrajectoryGroup:
    g.trajectories[1] = dataclasses.replace(g.trajectories[1], **changes)
    return g


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda g: _traj(g, behavior_logprobs=np.zeros(3, np.float32)), "trajectories[1].behavior_logprobs"),
        (
            lambda g: _traj(g, behavior_logprobs=np.full(16, np.nan, np.float32)),
            "trajectories[1].behavior_logprobs",
        ),
        (
            lambda g: _traj(g, behavior_logprobs=np.full(16, -np.inf, np.float32)),
            "trajectories[1].behavior_logprobs",
        ),
        (
            lambda g: _traj(g, behavior_logprobs=np.full(16, 0.5, np.float32)),
            "trajectories[1].behavior_logprobs",
        ),
        (lambda g: _traj(g, response_ids=np.full(16, -1, np.int32)), "trajectories[1].response_ids"),
        (lambda g: _traj(g, response_ids=np.arange(16, dtype=np.float32)), "trajectories[1].response_ids"),
        (lambda g: _traj(g, versions=np.zeros(3, np.int32)), "trajectories[1].versions"),
        (lambda g: _traj(g, reward=float("nan")), "trajectories[1].reward"),
        (lambda g: dataclasses.replace(g, prompt_ids=np.array([3, -2], np.int32)), "prompt_ids"),
        (lambda g: dataclasses.replace(g, trajectories=[]), "trajectories"),
        (lambda g: dataclasses.replace(g, schema_version=1), "schema_version"),
        (lambda g: dataclasses.replace(g, schema_version=7), "schema_version"),
        (lambda g: dataclasses.replace(g, group_id=""), "group_id"),
        (lambda g: dataclasses.replace(g, policy_version=-1), "policy_version"),
        (lambda g: dataclasses.replace(g, priority=float("inf")), "priority"),
        (lambda g: dataclasses.replace(g, metadata={"k": 1}), "metadata"),
        (lambda g: dataclasses.replace(g, sampling=SamplingParams(temperature=0.0)), "sampling"),
    ],
)
def test_validate_rejects(mutate, field: str) -> None:
    g = mutate(build_group(n=3, tokens=16))
    with pytest.raises(InvalidTrajectory) as e:
        encode_group(g)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("limits", "group_kw", "field"),
    [
        (CodecLimits(max_tokens_per_completion=15), {"tokens": 16}, "trajectories[0].response_ids"),
        (CodecLimits(max_completions_per_group=2), {"n": 3}, "trajectories"),
        (CodecLimits(max_prompt_tokens=7), {}, "prompt_ids"),
        (CodecLimits(max_payload_bytes=100), {}, "payload"),
    ],
)
def test_limits(limits: CodecLimits, group_kw: dict, field: str) -> None:
    g = build_group(**group_kw)
    data = encode_group(g)  # default limits accept it
    with pytest.raises(InvalidTrajectory) as e:
        encode_group(g, limits)
    assert e.value.field == field
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(data, limits)
    assert e.value.field == field


def test_validate_group_is_the_decode_check() -> None:
    g = build_group()
    validate_group(g)  # no error
    g.trajectories[0].behavior_logprobs[2] = 1.0
    with pytest.raises(
        InvalidTrajectory, match=r"trajectories\[0\].behavior_logprobs: log-probs must be <= 0"
    ):
        validate_group(g)


# --- frames by hand (also test_codec_decode.py's and test_codec_batch.py's)

_KEYS = ("lens", "prompt", "ids", "ver", "lp")


def _split(data: bytes) -> tuple[dict, dict[str, bytes]]:
    """Parse a frame by hand: its header map and the bytes of each array (offsets under `array_ends`, or
    schemas 2 and 3's `a`)."""
    size = struct.unpack_from("<I", data, 6)[0]
    head = msgpack.unpackb(data[10 : 10 + size])
    base = (10 + size + 7) // 8 * 8
    ends = head["array_ends"] if "array_ends" in head else head["a"]
    starts = [0, *ends[:-1]]
    return head, {k: data[base + a : base + b] for k, a, b in zip(_KEYS, starts, ends, strict=True)}


def _frame(head: dict, arrays: dict[str, bytes], magic: bytes = b"OPTG", version: int = 4) -> bytes:
    """Build a frame by hand: offsets from the arrays' sizes unless `head` already has wrong ones (under
    `array_ends`, or schemas 2 and 3's `a`)."""
    ends = head.get("ends_override") or list(itertools.accumulate(len(arrays[k]) for k in _KEYS))
    head = {**head, ("array_ends" if version >= 4 else "a"): ends}
    head.pop("ends_override", None)
    packed = msgpack.packb(head, use_bin_type=True)
    pad = bytes(-(10 + len(packed)) % 8)
    return (
        struct.pack("<4sHI", magic, version, len(packed)) + packed + pad + b"".join(arrays[k] for k in _KEYS)
    )


# --- environment tokens (schema 3)


def _with_env(mask_rows: list[list[bool] | None]) -> TrajectoryGroup:
    g = build_group(n=len(mask_rows), tokens=6)
    for t, row in zip(g.trajectories, mask_rows, strict=True):
        t.policy_mask = None if row is None else np.array(row, dtype=bool)
    return g


def test_policy_masks_round_trip_as_environment_spans() -> None:
    rows = [[True, True, False, False, True, False], None, [False, True, True, True, True, True]]
    data = encode_group(_with_env(rows))
    head, _ = _split(data)
    assert head["env_spans"] == [[2, 4, 5, 6], [], [0, 1]]
    out = decode_group(data)
    assert [None if t.policy_mask is None else t.policy_mask.tolist() for t in out.trajectories] == rows


def test_an_all_policy_mask_travels_as_no_mask() -> None:
    out = decode_group(encode_group(_with_env([[True] * 6])))
    assert out.trajectories[0].policy_mask is None


def test_frames_of_schema_2_still_decode_as_all_policy() -> None:
    head, arrays = _split(encode_group(build_group(n=2, tokens=4)))
    del head["env_spans"], head["array_ends"]
    short = {old: head[new] for old, new in SHORT_KEYS.items() if new in head}  # schema 2's keys
    out = decode_group(_frame(short, arrays, version=2))
    assert all(t.policy_mask is None for t in out.trajectories) and len(out.trajectories) == 2


@pytest.mark.parametrize(
    ("mask", "why"),
    [
        (np.array([True, False]), "length"),
        (np.array([1, 0, 1, 1, 1, 1]), "bool"),
        (np.zeros(6, dtype=bool), "no policy token"),
    ],
    ids=["length", "dtype", "all-environment"],
)
def test_encode_rejects_bad_masks_naming_the_field(mask, why) -> None:
    g = build_group(n=2, tokens=6)
    g.trajectories[1].policy_mask = mask
    with pytest.raises(InvalidTrajectory) as e:
        encode_group(g)
    assert e.value.field == "trajectories[1].policy_mask"
