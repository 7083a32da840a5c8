"""Batch codec: the same bytes and groups as the per-group codec, and the same rejections by field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.buffer.codec import CodecLimits, encode_group
from offpolicy.buffer.codec_batch import decode_groups, encode_groups
from offpolicy.buffer.errors import InvalidTrajectory
from tests.conftest import build_group
from tests.unit.buffer.test_codec import _assert_same, _frame, _split, groups

LIMITS = CodecLimits()


@settings(max_examples=100, deadline=None)
@given(st.lists(groups(), min_size=1, max_size=4))
def test_batch_encode_and_decode_match_the_per_group_codec(batch) -> None:
    payloads = encode_groups(batch, LIMITS)
    assert payloads == [encode_group(g) for g in batch]
    for g, back in zip(batch, decode_groups(payloads, LIMITS), strict=True):
        _assert_same(g, back)


def test_decoded_arrays_are_read_only_views_into_each_groups_own_payload() -> None:
    batch = [build_group(n=3, tokens=5, seed=i) for i in range(2)]
    payloads = encode_groups(batch, LIMITS)
    out = decode_groups(payloads, LIMITS)
    for g, data in zip(out, payloads, strict=True):
        whole = np.frombuffer(data, np.uint8)
        for t in g.trajectories:
            assert not t.response_ids.flags.writeable and np.shares_memory(t.response_ids, whole)
            assert not t.behavior_logprobs.flags.writeable and np.shares_memory(t.behavior_logprobs, whole)
        assert not g.prompt_ids.flags.writeable and np.shares_memory(g.prompt_ids, whole)


def test_a_bad_value_rejects_only_its_group_on_the_batch_path() -> None:
    good = [build_group(seed=i) for i in range(2)]
    bad = build_group(n=3, seed=9)
    bad.trajectories[2].response_ids[0] = -1  # plain int32 arrays: the batch path frames, then checks values
    out = encode_groups([good[0], bad, good[1]], LIMITS)
    assert isinstance(out[1], InvalidTrajectory) and out[1].field == "trajectories[2].response_ids"
    assert [out[0], out[2]] == [encode_group(g) for g in good]


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
    head, arrays = _split(encode_group(build_group(n=2, tokens=3, seed=1)))
    arrays["lp"] = np.array([-1, -1, -1, -1, -1, np.nan], "<f4").tobytes()
    with pytest.raises(InvalidTrajectory) as e:
        decode_groups([good, _frame(head, arrays)], LIMITS)
    assert e.value.field == "trajectories[1].behavior_logprobs"


def test_over_limit_payload_is_rejected_in_a_batch() -> None:
    limits = CodecLimits(max_payload_bytes=600)
    out = encode_groups([build_group(n=1, tokens=4), build_group(n=4, tokens=64)], limits)
    assert isinstance(out[0], bytes)
    assert isinstance(out[1], InvalidTrajectory) and out[1].field == "payload"


@pytest.mark.parametrize("tokens", [16, 20_000])  # a batch checked together, and one checked frame by frame
def test_batch_paths_reject_a_bad_value_in_one_group_by_field(tokens: int) -> None:
    groups = [build_group(n=2, tokens=tokens, seed=i) for i in range(3)]
    groups[1].trajectories[1].behavior_logprobs[tokens - 1] = 0.5
    out = encode_groups(groups, LIMITS)
    assert isinstance(out[1], InvalidTrajectory) and out[1].field == "trajectories[1].behavior_logprobs"
    assert [out[0], out[2]] == [encode_group(groups[0]), encode_group(groups[2])]
    good = [encode_group(g) for g in (groups[0], groups[2])]
    head, arrays = _split(good[1])
    lp = np.frombuffer(arrays["lp"], "<f4").copy()
    lp[tokens] = np.nan  # the first token of trajectory 1
    arrays["lp"] = lp.tobytes()
    with pytest.raises(InvalidTrajectory) as e:
        decode_groups([good[0], _frame(head, arrays)], LIMITS)
    assert e.value.field == "trajectories[1].behavior_logprobs"
    assert len(decode_groups(good, LIMITS)) == 2
