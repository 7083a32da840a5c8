"""Rate limiters (MinSize, SampleToInsertRatio), producer pacing, the asyncio buffer, Redis down and back."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.errors import BufferNotReady, RateLimited, StorageUnavailable
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer, ReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}


@pytest.fixture
def buf(redis_url, run_id):
    made = []

    def make(registry=None, **cfg) -> ReplayBuffer:
        b = ReplayBuffer(redis_url, f"{run_id}-{len(made)}", BufferConfig(**{**FAST, **cfg}), registry)
        made.append(b)
        return b

    yield make
    for b in made:
        b.clear()
        b.close()


def test_min_size_then_buffer_not_ready(buf) -> None:
    b = buf(min_size_to_sample=3)
    b.insert_many([build_group(0), build_group(0)])
    with pytest.raises(BufferNotReady, match="below min_size_to_sample"):
        b.sample(1, 0, timeout_s=0.05)
    b.insert(build_group(0))
    assert len(b.sample(1, 0, timeout_s=0)) == 1


def test_too_few_fresh_groups_is_not_ready(buf) -> None:
    b = buf(max_staleness=1)
    b.insert_many([build_group(0), build_group(5)])
    with pytest.raises(BufferNotReady, match="too few eligible"):
        b.sample(2, 5, timeout_s=0.02)


def test_sample_to_insert_ratio(buf) -> None:
    # spi 1, min size 2, error buffer 1: min_diff 1, max_diff 3; diff = inserted*1 - sampled
    reg = CollectorRegistry()
    b = buf(reg, samples_per_insert=1.0, error_buffer=1.0, min_size_to_sample=2, max_times_sampled=None,
            sampler="fifo", insert_timeout_s=0.05)  # fmt: skip
    assert len(b.insert_many([build_group(0) for _ in range(3)]).inserted) == 3  # diff 3 = max_diff
    with pytest.raises(RateLimited, match="refused inserts"):
        b.insert(build_group(0))  # diff would be 4 > 3
    assert len(b.sample(2, 0, timeout_s=0)) == 2  # diff 3 - 2 = 1 >= min_diff
    with pytest.raises(RateLimited, match="samples_per_insert"):
        # diff would be 0 < 1. The wait's deadline starts before the first script call: 0.5 s leaves room
        # for at least one wait (counted below) even when that call is slow.
        b.sample(1, 0, timeout_s=0.5)
    assert b.insert(build_group(0))  # diff 2 <= 3
    assert reg.get_sample_value("offpolicy_buffer_rate_limited_waits_total", {"op": "insert"}) > 0
    assert reg.get_sample_value("offpolicy_buffer_rate_limited_waits_total", {"op": "sample"}) > 0
    with pytest.raises(ValueError, match="deadlock"):
        b.sample(3, 0)  # 3 > 2 * error_buffer: could never be allowed


def test_pacing_max_ahead(buf) -> None:
    b = buf(max_ahead=3, max_staleness=2)
    b.insert_many([build_group(0), build_group(3), build_group(4)])
    assert b.wait_for_room(5, timeout_s=0) == 2  # version 0 is too stale to count for a producer at 5
    b.insert(build_group(5))
    with pytest.raises(RateLimited, match="max_ahead=3"):
        b.wait_for_room(5, timeout_s=0.05)
    b.sample(1, 5, timeout_s=0)  # drops v0 (stale), consumes v3
    assert b.wait_for_room(5, timeout_s=0) == 2


def test_metrics_on_injected_registry(buf) -> None:
    reg = CollectorRegistry()
    b = buf(reg, max_size=2, max_times_sampled=None, max_staleness=1)
    g = build_group(3)
    b.insert_many([build_group(0), g, g, build_group(3)])
    b.sample(1, 4, timeout_s=0)
    get = reg.get_sample_value
    assert get("offpolicy_buffer_inserts_total") == 3
    assert get("offpolicy_buffer_duplicates_total") == 1
    assert get("offpolicy_buffer_evictions_total", {"reason": "max_size"}) == 1
    assert get("offpolicy_buffer_drops_total", {"reason": "evicted_unsampled"}) == 1
    assert get("offpolicy_buffer_samples_total") == 1
    assert get("offpolicy_buffer_sampled_staleness_versions_count") == 1
    assert get("offpolicy_buffer_sampled_staleness_versions_bucket", {"le": "1.0"}) == 1
    assert get("offpolicy_buffer_size_groups") == 2
    assert get("offpolicy_buffer_fill_ratio") == 1.0
    assert get("offpolicy_buffer_insert_latency_seconds_count") == 1


async def test_async_buffer_same_contract(redis_url, run_id) -> None:
    b = AsyncReplayBuffer(redis_url, run_id, BufferConfig(**FAST, max_ahead=2))
    try:
        g = build_group(1)
        assert await b.insert(g) is True
        assert await b.insert(g) is False
        r = await b.insert_many([build_group(2), build_group(3)])
        assert len(r.inserted) == 2
        with pytest.raises(RateLimited):
            await b.wait_for_room(3, timeout_s=0.02)
        out = await b.sample(2, 3, timeout_s=0)
        assert [x.policy_version for x in out] == [1, 2]
        assert (await b.stats()).size == 1
        with pytest.raises(BufferNotReady):
            await b.sample(2, 3, timeout_s=0.02)
    finally:
        await b.clear()
        await b.close()


def test_redis_down_and_back(tmp_path, run_id) -> None:
    with EmbeddedRedis.start(tmp_path) as server:
        b = ReplayBuffer(server.url, run_id, BufferConfig(storage_timeout_s=1.0, socket_timeout_s=0.5))
        b.insert(build_group(0))
        server.stop()
        # the sample's own wait (60 s) is far longer: an outage must end it at the storage bound instead
        for op in (lambda: b.insert(build_group(0)), lambda: b.sample(1, 0, timeout_s=60), b.stats):
            t0 = time.monotonic()
            with pytest.raises(StorageUnavailable):
                op()
            # the bound (1 s) plus one socket timeout; loose, as a hang guard on a slow, busy machine
            assert time.monotonic() - t0 < 10.0
        server.restart()
        assert b.insert(build_group(0)) is True
        assert b.stats().size == 2  # the first insert survived the graceful restart (AOF)
        assert len(b.sample(2, 0)) == 2
        b.close()
