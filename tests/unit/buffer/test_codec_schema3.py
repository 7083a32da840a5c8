"""Codec: a frame written by the previous codec (schema 3, main 7892760: short header keys) still decodes to
the group it was made from, and re-encodes as schema 4 with the same values under the full key names.

tests/data/group_schema3.hex is that frame, hex, 96 digits a line: `SCHEMA3_GROUP` below encoded by
`encode_group` of main 7892760 (`git archive 7892760 offpolicy/buffer offpolicy/config offpolicy/__init__.py`
into a folder on PYTHONPATH). It holds every header key of schema 3: versions on two trajectories,
environment spans on one, metadata and a priority.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from offpolicy.buffer.codec import SHORT_KEYS, decode_group, encode_group
from offpolicy.buffer.types import (
    PLAIN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    SamplingParams,
    Trajectory,
    TrajectoryGroup,
)
from tests.unit.buffer.test_codec import _assert_same, _split

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "group_schema3.hex"
_ZEROS = np.zeros(6, np.int32)
SCHEMA3_GROUP = TrajectoryGroup(
    group_id="0123456789abcdef0123456789abcdef",
    prompt_id="p0",
    prompt_ids=np.array([1, 20, 21, 22], np.int32),
    policy_version=0,
    actor_id="actor-schema3",
    created_at=1767225600.5,
    sampling=SamplingParams(temperature=0.9, top_p=1.0, top_k=-1, max_tokens=6),
    trajectories=[
        Trajectory(
            np.array([40, 41, 42, 40, 43, 44], np.int32),
            np.array([-4.5, -4.75, -4.25, -4.5, -4.625, -4.375], np.float32),
            0.5,
            "length",
        ),
        Trajectory(
            np.array([45, 40, 46, 47, 48, 40], np.int32),
            np.array([-4.5, -4.5, -4.25, -4.75, -4.5, -4.5], np.float32),
            1.0 / 3.0,
            "length",
            versions=_ZEROS,
        ),
        Trajectory(
            np.array([49, 50, 40, 51, 52, 53], np.int32),
            np.array([-4.25, -4.5, -4.5, -4.5, -4.5, -4.75], np.float32),
            0.25,
            "stop",
            versions=_ZEROS,
            policy_mask=np.array([True, True, False, False, True, True]),
        ),
    ],
    metadata={"source": "schema3-fixture"},
    priority=1.5,
)


def schema3_frame() -> bytes:
    """The frame main 7892760's codec wrote for `SCHEMA3_GROUP`."""
    return bytes.fromhex("".join(FIXTURE.read_text().split()))


def test_the_fixture_is_a_schema_3_frame_with_short_keys() -> None:
    data = schema3_frame()
    assert data[:4] == b"OPTG" and struct.unpack_from("<H", data, 4)[0] == 3
    head, _ = _split(data)
    assert set(head) == set(SHORT_KEYS)


def test_a_schema_3_frame_decodes_to_the_group_it_was_made_from() -> None:
    out = decode_group(schema3_frame())
    _assert_same(SCHEMA3_GROUP, out)
    assert out.schema_version == SCHEMA_VERSION  # decoded records are the current schema's, as before
    assert out.trajectories[2].policy_mask.tolist() == [True, True, False, False, True, True]
    assert out.trajectories[0].versions is None and out.trajectories[1].versions.tolist() == [0] * 6


def test_it_re_encodes_as_schema_4_the_same_values_under_the_full_names() -> None:
    old = schema3_frame()
    new = encode_group(decode_group(old))
    assert struct.unpack_from("<H", new, 4)[0] == PLAIN_SCHEMA_VERSION == 4  # no routed experts: schema 4
    old_head, old_arrays = _split(old)
    new_head, new_arrays = _split(new)
    assert {SHORT_KEYS[k]: v for k, v in old_head.items()} == new_head  # the key table, value for value
    assert old_arrays == new_arrays  # the array section is unchanged
    _assert_same(SCHEMA3_GROUP, decode_group(new))
