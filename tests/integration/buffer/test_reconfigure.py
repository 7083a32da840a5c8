"""Runtime reconfiguration keeps the buffer and its metrics; every known label child exports 0 at start."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.metrics import DROP_REASONS, EVICTION_REASONS, REJECTED_FIELDS, WAIT_OPS, BufferMetrics
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer, ReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis


def test_every_known_label_child_is_exported_at_zero_before_any_event() -> None:
    reg = CollectorRegistry()
    BufferMetrics(reg)
    for field in REJECTED_FIELDS:
        assert reg.get_sample_value("offpolicy_buffer_rejected_total", {"field": field}) == 0.0
    for reason in EVICTION_REASONS:
        assert reg.get_sample_value("offpolicy_buffer_evictions_total", {"reason": reason}) == 0.0
    for reason in DROP_REASONS:
        assert reg.get_sample_value("offpolicy_buffer_drops_total", {"reason": reason}) == 0.0
    for op in WAIT_OPS:
        assert reg.get_sample_value("offpolicy_buffer_rate_limited_waits_total", {"op": op}) == 0.0


def test_reconfigure_applies_the_new_config_and_keeps_the_registry(any_redis, run_id) -> None:
    reg = CollectorRegistry()
    with ReplayBuffer(any_redis.url, run_id, BufferConfig.queue(), reg) as b:
        b.insert_many([build_group(seed=i) for i in range(2)])
        b.sample(1, 0)  # queue: consumed at once
        assert b.stats().size == 1
        b.reconfigure(BufferConfig.uniform_replay(socket_timeout_s=3.0))  # reuse until evicted
        assert b.config.max_times_sampled is None
        b.sample(1, 0)
        b.sample(1, 0)
        assert b.stats().size == 1
        assert reg.get_sample_value("offpolicy_buffer_samples_total") == 3.0
        assert reg.get_sample_value("offpolicy_buffer_evictions_total", {"reason": "max_times_sampled"}) == 1
        assert b._client.connection_pool.connection_kwargs["socket_timeout"] == 3.0


async def test_async_reconfigure_applies_the_new_config_and_keeps_the_registry(any_redis, run_id) -> None:
    reg = CollectorRegistry()
    async with AsyncReplayBuffer(any_redis.url, run_id, BufferConfig.queue(max_size=10), reg) as b:
        b.reconfigure(BufferConfig.queue(max_size=2))
        await b.insert_many([build_group(seed=i) for i in range(3)])
        assert (await b.stats()).size == 2
        assert reg.get_sample_value("offpolicy_buffer_evictions_total", {"reason": "max_size"}) == 1.0
        assert reg.get_sample_value("offpolicy_buffer_inserts_total") == 3.0
