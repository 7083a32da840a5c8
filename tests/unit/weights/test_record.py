"""The policy record's JSON: `kind` (`full` | `lora`) is written, and a record without it (an older
learner's) reads as `full`."""

from __future__ import annotations

import json

import pytest

from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.weights.record import PolicyRecord


def test_kind_is_encoded_and_decoded():
    for kind in ("full", "lora"):
        record = PolicyRecord(3, "run/weights/v3", "ab" * 32, 1000.5, kind)
        doc = json.loads(record.encode())
        assert doc["kind"] == kind and doc["schema_version"] == 1
        assert PolicyRecord.decode(record.encode()) == record


def test_a_record_without_kind_is_full_weights():
    old = json.dumps({"schema_version": 1, "version": 2, "weights_uri": "/w/v2", "sha256": "0" * 64,
                      "published_at": 7})  # fmt: skip
    record = PolicyRecord.decode(old)
    assert record == PolicyRecord(2, "/w/v2", "0" * 64, 7.0) and record.kind == "full"
    assert PolicyRecord(2, "/w/v2", "0" * 64, 7.0).kind == "full"  # the default, as before


@pytest.mark.parametrize("kind", ["adapter", "", 1, None])
def test_an_unknown_kind_is_refused_naming_the_field(kind):
    doc = {"schema_version": 1, "version": 2, "weights_uri": "/w", "sha256": "0", "published_at": 1.0}
    with pytest.raises(InvalidTrajectory) as e:
        PolicyRecord.decode(json.dumps(doc | {"kind": kind}))
    assert e.value.field == "policy.kind"
