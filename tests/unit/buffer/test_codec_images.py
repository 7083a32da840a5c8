"""Image references in the frame (schema 6): written only for a group that shows images, read back in
order, and a bad reference refused naming its index, on encode and on decode."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import msgpack
import pytest

from offpolicy.buffer.codec import PREFIX, decode_group, encode_group
from offpolicy.buffer.codec_batch import decode_groups, encode_groups
from offpolicy.buffer.config import CodecLimits
from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.types import IMAGES_SCHEMA_VERSION, PLAIN_SCHEMA_VERSION
from tests.conftest import build_group

SHAS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]


def version(frame: bytes) -> int:
    return PREFIX.unpack_from(frame)[1]


def test_images_round_trip_under_schema_6_and_plain_groups_stay_schema_4() -> None:
    g = dataclasses.replace(build_group(n=3), images=[SHAS[1], SHAS[0], SHAS[1]])  # order and repeats kept
    frame = encode_group(g)
    assert version(frame) == IMAGES_SCHEMA_VERSION
    assert decode_group(frame).images == [SHAS[1], SHAS[0], SHAS[1]]
    plain = build_group(n=3)
    assert version(encode_group(plain)) == PLAIN_SCHEMA_VERSION
    assert decode_group(encode_group(plain)).images == []
    both = decode_groups([bytes(f) for f in encode_groups([g, plain], CodecLimits())], CodecLimits())
    assert [x.images for x in both] == [g.images, []]


@pytest.mark.parametrize(
    ("images", "field"),
    [
        ([SHAS[0], SHAS[0].upper()], "images[1]"),
        ([SHAS[0][:-1]], "images[0]"),
        ([7], "images[0]"),
        ("abc", "images"),
        (SHAS * 2, "images"),  # past max_images_per_group=5
    ],
)
def test_a_bad_image_reference_is_refused_naming_it(images, field: str) -> None:
    limits = CodecLimits(max_images_per_group=5)
    g = dataclasses.replace(build_group(n=2), images=images)
    with pytest.raises(InvalidTrajectory) as e:
        encode_group(g, limits)
    assert e.value.field == field
    (out,) = encode_groups([g], limits)
    assert isinstance(out, InvalidTrajectory) and out.field == field


def test_a_frame_with_a_bad_reference_does_not_decode() -> None:
    frame = bytearray(encode_group(dataclasses.replace(build_group(n=2), images=[SHAS[0]])))
    at = frame.find(SHAS[0].encode())
    frame[at] = ord("Z")  # the header's first reference, no longer a digest
    head = struct.unpack_from("<I", frame, 6)[0]
    assert "images" in msgpack.unpackb(bytes(frame[PREFIX.size : PREFIX.size + head]))
    with pytest.raises(InvalidTrajectory) as e:
        decode_group(bytes(frame))
    assert e.value.field == "images[0]"
