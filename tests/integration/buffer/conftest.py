"""Fixtures of the buffer's integration tests."""

from __future__ import annotations

import pytest
import redis

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer

FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}


@pytest.fixture
def env(any_redis, run_id):
    """(make buffer, raw client, keys) on Redis 6.2 and 7.x."""
    made = []
    raw = redis.Redis.from_url(any_redis.url)

    def make(registry=None, **cfg) -> ReplayBuffer:
        b = ReplayBuffer(any_redis.url, run_id, BufferConfig(**{**FAST, **cfg}), registry)
        made.append(b)
        return b

    yield make, raw, BufferKeys.for_run(run_id)
    for b in made:
        b.clear()
        b.close()
    raw.close()
