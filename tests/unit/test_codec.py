"""Codec: round trip (property test) and every rejection `decode_group` / `validate_group` must make."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.codec import CodecLimits, decode_group, encode_group, validate_group
from buffer.errors import InvalidTrajectory
from buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from tests.conftest import build_group

_ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)
_text = st.text(max_size=12)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    ids = np.array(draw(_ids), dtype=np.int32)
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
    return Trajectory(ids, np.array(lps, dtype=np.float32), reward, draw(_text), versions)


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


@settings(max_examples=150, deadline=None)
@given(groups())
def test_round_trip(group: TrajectoryGroup) -> None:
    _assert_same(group, decode_group(encode_group(group)))


def test_arrays_are_raw_little_endian() -> None:
    g = build_group(n=1, tokens=3)
    doc = msgpack.unpackb(encode_group(g))
    assert doc["v"] == 1
    assert doc["tr"]["ids"] == g.trajectories[0].response_ids.astype("<i4").tobytes()
    assert doc["tr"]["lp"] == g.trajectories[0].behavior_logprobs.astype("<f4").tobytes()
    assert doc["tr"]["n"] == np.array([3], "<i4").tobytes()


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
        (lambda g: dataclasses.replace(g, schema_version=2), "schema_version"),
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


# --- rejections of bytes from the wire (decode_group)


def _doc() -> dict:
    return msgpack.unpackb(encode_group(build_group(n=2, tokens=4)))


def _decode_field(doc: dict) -> str:
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(msgpack.packb(doc, use_bin_type=True))
    return e.value.field


def test_decode_rejects_unknown_schema_version() -> None:
    doc = _doc()
    doc["v"] = 99
    assert _decode_field(doc) == "schema_version"


def test_decode_rejects_garbage() -> None:
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(b"\xc1not msgpack")
    assert e.value.field == "payload"
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(msgpack.packb([1, 2]))
    assert e.value.field == "payload"


def test_decode_rejects_length_mismatch() -> None:
    doc = _doc()  # 2 trajectories of 4 tokens: one log-prob short lands in trajectory 1
    doc["tr"]["lp"] = doc["tr"]["lp"][:-4]
    assert _decode_field(doc) == "trajectories[1].behavior_logprobs"
    doc = _doc()
    doc["tr"]["ids"] = doc["tr"]["ids"][:-20]  # 3 of 8 ids: trajectory 0 is the first one short
    assert _decode_field(doc) == "trajectories[0].response_ids"


def test_decode_rejects_torn_array() -> None:
    doc = _doc()
    doc["tr"]["ids"] = doc["tr"]["ids"][:-1]
    assert _decode_field(doc) == "trajectories.response_ids"


def test_decode_rejects_positive_and_nonfinite_logprobs() -> None:
    for bad in (0.25, float("nan"), float("inf")):
        doc = _doc()
        doc["tr"]["lp"] = np.array([-1.0, -1.0, -1.0, -1.0, -1.0, bad, -0.5, -0.1], "<f4").tobytes()
        assert _decode_field(doc) == "trajectories[1].behavior_logprobs"


def test_decode_rejects_negative_ids_and_empty_group() -> None:
    doc = _doc()
    doc["p"] = np.array([1, -5], "<i4").tobytes()
    assert _decode_field(doc) == "prompt_ids"
    doc = _doc()
    doc["tr"]["n"] = b""
    assert _decode_field(doc) == "trajectories"
    doc = _doc()
    doc["tr"]["ids"] = np.array([1, 2, 3, 4, 5, -6, 7, 8], "<i4").tobytes()
    assert _decode_field(doc) == "trajectories[1].response_ids"


def test_decode_rejects_missing_and_mistyped_fields() -> None:
    doc = _doc()
    del doc["gid"]
    assert _decode_field(doc) == "group_id"
    doc = _doc()
    doc["pv"] = "3"
    assert _decode_field(doc) == "policy_version"
    doc = _doc()
    doc["tr"]["rw"][1] = "1.0"
    assert _decode_field(doc) == "trajectories[1].reward"


def test_validate_group_is_the_decode_check() -> None:
    g = build_group()
    validate_group(g)  # no error
    g.trajectories[0].behavior_logprobs[2] = 1.0
    with pytest.raises(
        InvalidTrajectory, match=r"trajectories\[0\].behavior_logprobs: log-probs must be <= 0"
    ):
        validate_group(g)
