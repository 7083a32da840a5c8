"""Codec: every rejection `decode_group` must make of bytes from the wire, on frames built by hand (a bad
prefix, header, offset, length, value or environment span), each naming its field."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from offpolicy.buffer.codec import decode_group, encode_group
from offpolicy.buffer.errors import InvalidTrajectory
from tests.conftest import build_group
from tests.unit.buffer.test_codec import _frame, _split


def _parts() -> tuple[dict, dict[str, bytes]]:
    return _split(encode_group(build_group(n=2, tokens=4)))


def _decode_field(head: dict, arrays: dict[str, bytes], **kw) -> str:
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(_frame(head, arrays, **kw))
    return e.value.field


def test_decode_rejects_unknown_schema_version() -> None:
    assert _decode_field(*_parts(), version=99) == "schema_version"
    assert _decode_field(*_parts(), version=1) == "schema_version"


def test_decode_rejects_bad_magic_and_v1_payloads() -> None:
    assert _decode_field(*_parts(), magic=b"NOPE") == "payload"
    v1 = msgpack.packb({"v": 1, "gid": "g", "tr": {"n": b"", "ids": b"", "lp": b""}}, use_bin_type=True)
    with pytest.raises(InvalidTrajectory, match="bad magic") as e:
        decode_group(v1)
    assert e.value.field == "payload"


def test_decode_rejects_truncated_payloads() -> None:
    data = encode_group(build_group(n=2, tokens=4))
    for cut in (0, 3, 9, 20, len(data) - 4, len(data) - 1):  # in the prefix, the header, the arrays
        with pytest.raises(InvalidTrajectory) as e:
            decode_group(data[:cut])
        assert e.value.field == "payload", cut
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(data + b"\0\0\0\0")  # extra bytes after the arrays the header describes
    assert e.value.field == "payload"


def test_decode_rejects_a_header_that_is_not_a_msgpack_map() -> None:
    for packed in (b"\xc1", msgpack.packb([1, 2])):
        data = struct.pack("<4sHI", b"OPTG", 2, len(packed)) + packed
        data += bytes(-len(data) % 8)
        with pytest.raises(InvalidTrajectory) as e:
            decode_group(data)
        assert e.value.field == "payload"


def test_decode_rejects_offsets_that_disagree_with_the_arrays() -> None:
    head, arrays = _parts()
    assert head["array_ends"] == [
        8,
        40,
        72,
        72,
        104,
    ]  # 2 lengths, 8 prompt ids, 8 ids, no versions, 8 log-probs
    for bad in (
        [8, 40, 72, 72, 108],  # past the end of the array section
        [8, 40, 72, 72, 100],  # short of it
        [8, 40, 70, 72, 104],  # not a multiple of 4
        [8, 40, 72, 36, 104],  # decreasing
        [-8, 40, 72, 72, 104],  # negative
        [8, 40, 72, 104],  # not 5 offsets
        [8, 40, 72.0, 72, 104],  # not ints
    ):
        assert _decode_field({**head, "ends_override": bad}, arrays) == "payload", bad
    # inside the section and consistent, but 1 length for 2 trajectories
    assert _decode_field({**head, "ends_override": [4, 40, 72, 72, 104]}, arrays) == "trajectories"


def test_decode_rejects_a_lengths_array_that_disagrees_with_the_header() -> None:
    head, arrays = _parts()
    arrays["lens"] = np.array([4, 4, 0], "<i4").tobytes()  # 3 lengths, 2 trajectories
    assert _decode_field(head, arrays) == "trajectories"
    head, arrays = _parts()
    arrays["lens"] = np.array([9, -1], "<i4").tobytes()
    assert _decode_field(head, arrays) == "trajectories"


def test_decode_rejects_length_mismatch() -> None:
    head, arrays = _parts()  # 2 trajectories of 4 tokens: one log-prob short lands in trajectory 1
    arrays["lp"] = arrays["lp"][:-4]
    assert _decode_field(head, arrays) == "trajectories[1].behavior_logprobs"
    head, arrays = _parts()
    arrays["ids"] = arrays["ids"][:-20]  # 3 of 8 ids: trajectory 0 is the first one short
    assert _decode_field(head, arrays) == "trajectories[0].response_ids"
    head, arrays = _parts()
    head["has_versions"] = [False, True]  # trajectory 1 claims versions the frame does not hold
    assert _decode_field(head, arrays) == "trajectories[1].versions"
    head, arrays = _parts()
    arrays["ver"] = np.zeros(4, "<i4").tobytes()  # versions nobody claims
    assert _decode_field(head, arrays) == "trajectories[1].versions"


def test_decode_rejects_positive_and_nonfinite_logprobs() -> None:
    for bad in (0.25, float("nan"), float("inf"), float("-inf")):
        head, arrays = _parts()
        arrays["lp"] = np.array([-1.0, -1.0, -1.0, -1.0, -1.0, bad, -0.5, -0.1], "<f4").tobytes()
        assert _decode_field(head, arrays) == "trajectories[1].behavior_logprobs"


def test_decode_rejects_negative_ids_and_versions_and_empty_group() -> None:
    head, arrays = _parts()
    arrays["prompt"] = np.array([1, -5], "<i4").tobytes()
    assert _decode_field(head, arrays) == "prompt_ids"
    head, arrays = _parts()
    head.update(reward=[], finish_reason=[], has_versions=[])
    arrays.update(lens=b"", ids=b"", lp=b"")
    assert _decode_field(head, arrays) == "trajectories"
    head, arrays = _parts()
    arrays["ids"] = np.array([1, 2, 3, 4, 5, -6, 7, 8], "<i4").tobytes()
    assert _decode_field(head, arrays) == "trajectories[1].response_ids"
    head, arrays = _parts()
    head["has_versions"] = [False, True]
    arrays["ver"] = np.array([0, 1, -1, 1], "<i4").tobytes()
    assert _decode_field(head, arrays) == "trajectories[1].versions"


def test_decode_rejects_missing_and_mistyped_fields() -> None:
    for key, value, field in (
        ("group_id", None, "group_id"),
        ("policy_version", "3", "policy_version"),
        ("policy_version", -1, "policy_version"),
        ("actor_id", "", "actor_id"),
        ("created_at", float("nan"), "created_at"),
        ("sampling", [1.0, 1.0, -1], "sampling"),
        ("sampling", [0.0, 1.0, -1, 8], "sampling"),
        ("metadata", {"k": 1}, "metadata"),
        ("priority", -1.0, "priority"),
        ("reward", [1.0, "1.0"], "trajectories[1].reward"),
        ("reward", [1.0, float("inf")], "trajectories[1].reward"),
        ("reward", [1.0], "trajectories.finish_reason"),  # 1 reward, 2 finish reasons
        ("finish_reason", ["stop"], "trajectories.finish_reason"),
        ("finish_reason", ["stop", 3], "trajectories[1].finish_reason"),
        ("has_versions", [False, 0], "trajectories[1].versions"),
    ):
        head, arrays = _parts()
        if value is None:
            del head[key]
        else:
            head[key] = value
        assert _decode_field(head, arrays) == field, (key, value)


@pytest.mark.parametrize(
    "spans",
    [[[], [1]], [[], [3, 2]], [[], [0, 9]], [[], [0, 6]], [[], [4, 5, 1, 2]], [[], "x"], [[]]],
    ids=["odd", "reversed", "outside", "all-environment", "unordered", "type", "count"],
)
def test_decode_rejects_bad_spans_naming_the_field(spans) -> None:
    head, arrays = _split(encode_group(build_group(n=2, tokens=6)))
    field = _decode_field({**head, "env_spans": spans}, arrays)
    assert field in ("trajectories[1].policy_mask", "trajectories.policy_mask")
