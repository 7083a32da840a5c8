"""Routed experts (MoE) in the record and the frame: validation naming the field, the compact dtypes (uint8 up
to 256 experts, else uint16) round trip, schema 5 only for routed groups, and the bytes a token costs."""

from __future__ import annotations

import json
import struct

import msgpack
import numpy as np
import pytest

from offpolicy.buffer.codec import CodecLimits, decode_group, encode_group
from offpolicy.buffer.codec_batch import decode_groups, encode_groups
from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.json_records import group_from_json, group_to_json
from offpolicy.buffer.types import TrajectoryGroup
from tests.conftest import build_group

LAYERS, TOP_K = 3, 2


def routed_group(num_experts: int = 8, n: int = 3, tokens: int = 16, seed: int = 0) -> TrajectoryGroup:
    """`build_group` whose trajectories (all but the second) carry routed experts [tokens, LAYERS, TOP_K]."""
    g = build_group(n=n, tokens=tokens, seed=seed)
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    for i, t in enumerate(g.trajectories):
        if i != 1:
            t.routed_experts = rng.integers(0, num_experts, (tokens, LAYERS, TOP_K)).astype(dtype)
    g.num_experts = num_experts
    return g


def _field(g: TrajectoryGroup) -> str:
    with pytest.raises(InvalidTrajectory) as e:
        encode_group(g)
    return e.value.field


@pytest.mark.parametrize(("experts", "dtype"), [(8, np.uint8), (256, np.uint8), (300, np.uint16)])
def test_routed_experts_round_trip_in_the_compact_dtype(experts: int, dtype: type) -> None:
    g = routed_group(experts)
    g.trajectories[0].routed_experts[0, 0, 0] = experts - 1  # the largest expert index
    data = encode_group(g)
    assert struct.unpack_from("<H", data, 4)[0] == 5  # a routed group needs a reader of schema 5
    out = decode_group(data)
    assert out.num_experts == experts
    for a, b in zip(g.trajectories, out.trajectories, strict=True):
        if a.routed_experts is None:
            assert b.routed_experts is None
        else:
            assert b.routed_experts.dtype == dtype and b.routed_experts.shape == (16, LAYERS, TOP_K)
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)


def test_a_group_without_routing_is_still_written_as_schema_4() -> None:
    data = encode_group(build_group(n=2, tokens=8))
    assert struct.unpack_from("<H", data, 4)[0] == 4
    assert decode_group(data).num_experts is None


def test_wider_integers_are_stored_compact() -> None:
    g = routed_group(8)
    wide = g.trajectories[0].routed_experts.astype(np.int64)
    g.trajectories[0].routed_experts = wide
    out = decode_group(encode_group(g)).trajectories[0].routed_experts
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, wide)


@pytest.mark.parametrize(("experts", "itemsize"), [(128, 1), (300, 2)])
def test_routed_bytes_per_token_in_the_frame(experts: int, itemsize: int) -> None:
    """The routed array's bytes in the frame (after `array_ends[4]`, to the frame's end) per routed token:
    `layers x top_k x itemsize`, within the budget of 2 x layers x top_k."""
    g = routed_group(experts, tokens=64)
    data = encode_group(g)
    head_len = struct.unpack_from("<I", data, 6)[0]
    doc = msgpack.unpackb(data[10 : 10 + head_len])
    base = (10 + head_len + 7) & ~7
    routed_tokens = sum(len(t.response_ids) for t in g.trajectories if t.routed_experts is not None)
    routed_bytes_per_token = (len(data) - base - doc["array_ends"][4]) / routed_tokens
    assert routed_bytes_per_token == LAYERS * TOP_K * itemsize <= 2 * LAYERS * TOP_K
    print(
        f"experts={experts}: routed_bytes_per_token={routed_bytes_per_token:g} layers={LAYERS} top_k={TOP_K}"
    )


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda g, t: setattr(t, "routed_experts", t.routed_experts[:-1]), "trajectories[0].routed_experts"),
        (lambda g, t: setattr(t, "routed_experts", t.routed_experts[:, 0]), "trajectories[0].routed_experts"),
        (lambda g, t: setattr(t, "routed_experts", t.routed_experts + 8), "trajectories[0].routed_experts"),
        (lambda g, t: setattr(t, "routed_experts", t.routed_experts - 1.0), "trajectories[0].routed_experts"),
        (
            lambda g, t: setattr(t, "routed_experts", t.routed_experts.astype(np.int16) - 1),
            "trajectories[0].routed_experts",
        ),
        (
            lambda g, t: setattr(g.trajectories[2], "routed_experts", np.zeros((16, LAYERS, 1), np.uint8)),
            "trajectories[2].routed_experts",
        ),
        (lambda g, t: setattr(t, "routed_experts", [[[0]]]), "trajectories[0].routed_experts"),
        (lambda g, t: setattr(g, "num_experts", None), "num_experts"),
        (lambda g, t: setattr(g, "num_experts", 70_000), "num_experts"),
        (lambda g, t: setattr(g, "num_experts", 1), "trajectories[0].routed_experts"),  # top_k > experts
    ],
    ids=[
        "rows",
        "ndim",
        "range",
        "float",
        "negative",
        "group-shape",
        "list",
        "no-experts",
        "too-many",
        "top-k",
    ],
)
def test_validation_names_the_routed_field(mutate, field: str) -> None:
    g = routed_group(8)
    mutate(g, g.trajectories[0])
    assert _field(g) == field


def test_a_bad_group_is_rejected_alone_in_a_batch() -> None:
    good, bad = routed_group(8, seed=1), routed_group(8, seed=2)
    bad.trajectories[2].routed_experts = bad.trajectories[2].routed_experts[:3]
    out = encode_groups([good, bad, build_group(seed=3)], CodecLimits())
    assert isinstance(out[1], InvalidTrajectory) and out[1].field == "trajectories[2].routed_experts"
    decoded = decode_groups([out[0], out[2]], CodecLimits())
    np.testing.assert_array_equal(
        decoded[0].trajectories[2].routed_experts, good.trajectories[2].routed_experts
    )
    assert decoded[1].num_experts is None


def test_a_frame_with_an_expert_out_of_range_or_cut_short_is_rejected() -> None:
    g = routed_group(8)
    data = bytearray(encode_group(g))
    data[-1] = 8  # the last routed value (trajectory 2's last row): out of [0, 8)
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(bytes(data))
    assert e.value.field == "trajectories[2].routed_experts"
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(bytes(data[:-6]))  # one row short
    assert e.value.field == "routed_experts"
    schema4 = bytearray(encode_group(g))
    struct.pack_into("<H", schema4, 4, 4)  # routed bytes under a schema-4 label: not silently dropped
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(bytes(schema4))
    assert e.value.field == "payload"


def test_json_records_carry_routed_experts() -> None:
    g = routed_group(8)
    back = group_from_json(json.loads(json.dumps(group_to_json(g))))
    out = decode_group(encode_group(back))
    assert out.num_experts == 8 and out.trajectories[1].routed_experts is None
    np.testing.assert_array_equal(out.trajectories[0].routed_experts, g.trajectories[0].routed_experts)
    doc = group_to_json(g)
    doc["trajectories"][0]["routed_experts"] = [[[0, 1]], [[2]]]  # ragged
    with pytest.raises(InvalidTrajectory) as e:
        group_from_json(doc)
    assert e.value.field == "trajectories[0].routed_experts"
