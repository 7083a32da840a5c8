"""A group written by the previous codec (schema 3, main 7892760) still trains: stored as that codec's actors
stored it, or decoded and inserted again (schema 4), a learner on the embedded Redis samples it and steps.

The frame is tests/data/group_schema3.hex (tests/unit/buffer/test_codec_schema3.py says how it was made).
"""

from __future__ import annotations

import dataclasses
import struct
import uuid

import numpy as np
import pytest

from offpolicy.buffer.codec import decode_group
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.script_io import InsertReply
from offpolicy.buffer.storage import insert_transaction, script_source, sync_client
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401
from tests.unit.buffer.test_codec_schema3 import SCHEMA3_GROUP, schema3_frame

pytestmark = pytest.mark.redis


def store_as_schema_3(redis_url: str, run_id: str, config: BufferConfig) -> None:
    """The frame stored by the insert transaction the previous version's actors ran (the same Lua script:
    it never reads the payload), its bytes untouched."""
    client = sync_client(redis_url, config.socket_timeout_s)
    try:
        script = client.register_script(script_source("insert"))
        g = SCHEMA3_GROUP
        raw, _ = insert_transaction(
            client,
            script,
            config,
            BufferKeys.for_run(run_id),
            [(g.group_id, g.policy_version, 0.0, schema3_frame(), "")],
        )
        assert InsertReply.parse(raw).statuses == [1]  # inserted
        stored = client.get(BufferKeys.for_run(run_id).payload(g.group_id))
        assert stored == schema3_frame() and struct.unpack_from("<H", stored, 4)[0] == 3
    finally:
        client.close()


def test_a_group_of_the_previous_codec_trains(tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(tiny_dir, redis_url, tmp_path, groups_per_step=1)
    store_as_schema_3(redis_url, cfg.run_id, cfg.buffer)
    again = dataclasses.replace(decode_group(schema3_frame()), group_id=uuid.uuid4().hex)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert(again)  # the decoded group, inserted again: a schema 4 frame
        assert buf.stats().size == 2
    learner = Learner(cfg)
    try:
        steps = [learner.step() for _ in range(2)]  # one group a step: each of the two
    finally:
        learner.close()
    assert learner.version == 2
    for m in steps:
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]), m
        assert m["groups"] == 1.0 and m["tokens"] == 16.0, m  # 18 tokens, 2 of them the environment's
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        stats, dead = buf.stats(), buf.dead_letters()
    assert stats.sampled_total == 2 and not any(k.startswith("invalid") for k in stats.dropped_total), stats
    assert dead == []  # neither frame was set aside as undecodable
