"""Batch codec: the same bytes and groups as the per-group codec, and the same rejections by field."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.codec import CodecLimits, decode_group, encode_group
from buffer.codec_batch import decode_groups, encode_groups
from buffer.errors import InvalidTrajectory
from tests.conftest import build_group
from tests.unit.test_codec import _assert_same, groups

LIMITS = CodecLimits()


@settings(max_examples=100, deadline=None)
@given(st.lists(groups(), min_size=1, max_size=4))
def test_batch_encode_and_decode_match_the_per_group_codec(batch) -> None:
    payloads = encode_groups(batch, LIMITS)
    assert payloads == [encode_group(g) for g in batch]
    for g, back in zip(batch, decode_groups(payloads, LIMITS), strict=True):
        _assert_same(g, back)


def test_decoded_arrays_are_writable_views_of_one_buffer_per_field() -> None:
    batch = [build_group(n=3, tokens=5, seed=i) for i in range(2)]
    out = decode_groups(encode_groups(batch, LIMITS), LIMITS)
    a, b = out[0].trajectories[0].response_ids, out[1].trajectories[2].response_ids
    assert a.flags.writeable and b.flags.writeable and out[1].prompt_ids.flags.writeable
    assert a.base is b.base and len(a.base) == 2 * 3 * 5  # one array for the batch's tokens
    a[0] = 1234567
    assert out[0].trajectories[0].response_ids[0] == 1234567
    assert 1234567 not in out[0].trajectories[1].response_ids


def test_a_malformed_group_is_rejected_by_field_and_the_others_encode() -> None:
    good = [build_group(seed=i) for i in range(3)]
    bad = build_group(n=3)
    bad.trajectories[1].behavior_logprobs[2] = 0.5
    out = encode_groups([good[0], bad, good[1], good[2]], LIMITS)
    assert isinstance(out[1], InvalidTrajectory)
    assert out[1].field == "trajectories[1].behavior_logprobs"
    assert [out[0], out[2], out[3]] == [encode_group(g) for g in good]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda g: dataclasses.replace(g, prompt_ids=np.array([-1], np.int32)), "prompt_ids"),
        (lambda g: dataclasses.replace(g, trajectories=[]), "trajectories"),
        (lambda g: dataclasses.replace(g, policy_version=-1), "policy_version"),
        (lambda g: dataclasses.replace(g, metadata={"a": 1}), "metadata"),
    ],
)
def test_batch_rejections_name_the_same_field_as_the_exact_path(change, field) -> None:
    out = encode_groups([build_group(seed=1), change(build_group(seed=2))], LIMITS)
    assert isinstance(out[0], bytes) and isinstance(out[1], InvalidTrajectory) and out[1].field == field


def test_int64_inputs_take_the_exact_path_and_encode_the_same() -> None:
    g = build_group(n=2, tokens=4)
    g.trajectories[0].response_ids = g.trajectories[0].response_ids.astype(np.int64)
    assert encode_groups([g], LIMITS) == [encode_group(g)]


def test_decoding_a_batch_with_a_bad_payload_raises_naming_the_field() -> None:
    good = encode_group(build_group(seed=0))
    doc = msgpack.unpackb(encode_group(build_group(n=2, tokens=3, seed=1)))
    doc["tr"]["lp"] = np.array([-1, -1, -1, -1, -1, np.nan], "<f4").tobytes()
    with pytest.raises(InvalidTrajectory) as e:
        decode_groups([good, msgpack.packb(doc)], LIMITS)
    assert e.value.field == "trajectories[1].behavior_logprobs"
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(msgpack.packb(doc), LIMITS)
    assert e.value.field == "trajectories[1].behavior_logprobs"


def test_over_limit_payload_is_rejected_in_a_batch() -> None:
    limits = CodecLimits(max_payload_bytes=600)
    out = encode_groups([build_group(n=1, tokens=4), build_group(n=4, tokens=64)], limits)
    assert isinstance(out[0], bytes)
    assert isinstance(out[1], InvalidTrajectory) and out[1].field == "payload"
