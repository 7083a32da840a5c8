"""Poison groups on Redis 6.2 and 7.x: a stored payload that fails to decode is set aside (dead-letter
list, `dropped:invalid:<field>`) and its batch neighbours are returned; the learner sets aside groups it
cannot train; 0-token completions are rejected on insert, naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from offpolicy.buffer.errors import InvalidTrajectory
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}
C = "learner-0"


def _stored(raw, keys) -> set[str]:
    return {k.decode() for k in raw.zrange(keys.order, 0, -1)} | {k.decode() for k in raw.hkeys(keys.held)}


@pytest.mark.parametrize("leasing", [False, True], ids=["sample", "lease"])
@pytest.mark.parametrize("garbage", [b"garbage", b"OPTG\x02\x00\xff\xff\xff\xff"], ids=["magic", "truncated"])
def test_a_poison_payload_is_set_aside_and_its_neighbours_returned(env, leasing, garbage) -> None:
    make, raw, keys = env
    reg = CollectorRegistry()
    b = make(registry=reg, max_times_sampled=None if leasing else 1)
    groups = [build_group(v, seed=v) for v in range(4)]
    b.insert_many(groups)
    bad = groups[1].group_id
    raw.set(keys.payload(bad), garbage)  # corrupted behind the buffer's back
    if leasing:
        out = b.lease(4, 3, consumer=C, lease_s=60)
        got, dead = out.groups, out.dead_lettered
        assert len(out.lease_ids) == 3 and b.leases(C) == sorted(out.lease_ids, key=int)
    else:
        got, dead = b.sample(4, 3, timeout_s=0), None
    assert [g.group_id for g in got] == [g.group_id for g in groups if g.group_id != bad]
    if leasing:
        assert dead == {bad: "payload"}
    letters = b.dead_letters()
    assert len(letters) == 1
    assert letters[0]["group_id"] == bad and letters[0]["field"] == "payload"
    assert letters[0]["reason"].startswith("decode: ") and letters[0]["time_ms"] > 0
    assert bad not in _stored(raw, keys) and not raw.exists(keys.payload(bad))  # never chosen again
    assert b.stats().dropped_total == {"invalid:payload": 1}
    assert reg.get_sample_value("offpolicy_buffer_drops_total", {"reason": "invalid:payload"}) == 1


def test_the_learner_sets_aside_a_group_it_cannot_train(env) -> None:
    make, raw, keys = env
    b = make(max_times_sampled=1, dead_letter_max=2)
    groups = [build_group(v, seed=v) for v in range(4)]
    b.insert_many(groups)
    leased = b.lease(3, 3, consumer=C, lease_s=60)
    field = "trajectories[2].response_ids"
    assert b.dead_letter(C, leased.lease_ids[0], "token id 70000 >= vocab_size 32000", field)
    assert not b.dead_letter(C, leased.lease_ids[0], "again", field)  # no longer an outstanding lease
    assert not b.dead_letter("learner-9", leased.lease_ids[1], "not mine", field)
    assert b.ack(C, leased.lease_ids[:1]).unknown == (leased.lease_ids[0],)
    assert leased.groups[0].group_id not in _stored(raw, keys)
    assert b.dead_letter(None, groups[3].group_id, "set aside by id", "trajectories")
    assert b.dead_letter(C, leased.lease_ids[1], "third", field)
    letters = b.dead_letters(limit=10)
    assert len(letters) == 2  # dead_letter_max: the oldest record is trimmed, the counter keeps counting
    assert [x["reason"] for x in letters] == ["third", "set aside by id"]
    assert letters[1] == {
        **letters[1], "group_id": groups[3].group_id, "consumer": "", "lease_id": "", "field": "trajectories"
    }  # fmt: skip
    assert letters[0]["lease_id"] == leased.lease_ids[1] and letters[0]["consumer"] == C
    assert b.stats().dropped_total == {"invalid:trajectories.response_ids": 2, "invalid:trajectories": 1}
    assert b.stats().leases_outstanding == 1


def test_zero_token_completions_are_rejected_on_insert_naming_the_field(env) -> None:
    make, _, _ = env
    b = make()
    empty = build_group(0, seed=1)
    t = empty.trajectories[2]
    t.response_ids, t.behavior_logprobs = np.zeros(0, np.int32), np.zeros(0, np.float32)
    good = [build_group(0, seed=0), build_group(0, seed=2)]
    result = b.insert_many([good[0], empty, good[1]])
    assert result.rejected == {empty.group_id: "trajectories[2].response_ids"}
    assert result.inserted == (good[0].group_id, good[1].group_id)
    assert b.stats().rejected_total == {"trajectories.response_ids": 1}
    with pytest.raises(InvalidTrajectory, match="empty completion"):
        b.insert(empty)


def test_a_stored_zero_token_frame_is_a_poison_group(env) -> None:
    """A frame written before 0-token completions were rejected: set aside on sample, field named."""
    make, raw, keys = env
    b = make()
    g = build_group(0, n=2, tokens=3)
    b.insert(g)
    frame = bytearray(raw.get(keys.payload(g.group_id)))
    # the array section starts with int32 lens[n]; make the first trajectory's length 0 and keep the
    # frame's sizes consistent by giving its 3 tokens to the second
    section = frame.index(np.array([3, 3], np.int32).tobytes())
    frame[section : section + 8] = np.array([0, 6], np.int32).tobytes()
    raw.set(keys.payload(g.group_id), bytes(frame))
    b.insert(build_group(0, seed=5))
    got = b.sample(2, 0, timeout_s=0)
    assert [x.group_id for x in got] != [g.group_id] and len(got) == 1
    assert b.dead_letters()[0]["field"] == "trajectories[0].response_ids"
