"""Routed experts count in the buffer's byte budget (`max_bytes`, insert.lua): a stored group's payload is its
whole frame, routing included, and a routed group that does not fit is refused where the same group
without routing fits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from offpolicy.buffer.codec import encode_group
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.errors import BufferFull
from offpolicy.buffer.replay_buffer import ReplayBuffer
from tests.unit.buffer.test_routed_experts import LAYERS, TOP_K, routed_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01, "insert_timeout_s": 0.2}


def _without_routing(g):
    trs = [dataclasses.replace(t, routed_experts=None) for t in g.trajectories]
    return dataclasses.replace(g, trajectories=trs, num_experts=None)


def test_routed_bytes_are_in_the_byte_budget(redis_url, run_id) -> None:
    routed = routed_group(8, tokens=256)
    routed_bytes = sum(t.routed_experts.nbytes for t in routed.trajectories if t.routed_experts is not None)
    assert routed_bytes == 2 * 256 * LAYERS * TOP_K  # two of the three trajectories carry routing
    plain = _without_routing(routed)
    size, plain_size = len(encode_group(routed)), len(encode_group(plain))
    assert size >= plain_size + routed_bytes
    first = _without_routing(routed_group(8, tokens=256, seed=1))  # another group, of plain_size bytes
    assert len(encode_group(first)) == plain_size
    with ReplayBuffer(redis_url, run_id, BufferConfig(max_bytes=2 * plain_size, **FAST)) as b:
        assert b.insert(first)
        with pytest.raises(BufferFull):
            b.insert(routed)  # its routing does not fit the budget
        assert b.stats().payload_bytes == plain_size
        assert b.insert(plain)  # the same group without routing does
        assert b.stats().payload_bytes == 2 * plain_size
    with ReplayBuffer(redis_url, f"{run_id}-2", BufferConfig(**FAST)) as b:
        assert b.insert(routed)
        assert b.stats().payload_bytes == size
        (out,) = b.sample(1, consumer_version=0)
        np.testing.assert_array_equal(
            out.trajectories[0].routed_experts, routed.trajectories[0].routed_experts
        )
