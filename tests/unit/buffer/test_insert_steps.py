"""The insert loop's retry policy (`Core.insert_steps`, buffer/core.py), driven by hand without Redis: what
it asks the shells to do, what it sends again, and when it gives up. The shells' I/O is
tests/integration/buffer/."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.core import Core, CountRejected, ReadMaxmemory, SendChunk, Wait
from offpolicy.buffer.errors import BufferFull, RateLimited
from tests.conftest import build_group


def reply(*statuses: int) -> list:
    """insert.lua's raw reply: statuses, size, evicted, evicted unsampled, expired, bytes, evicted bytes."""
    return [list(statuses), 10, 0, 0, 0, 1000, 0]


def core(registry: CollectorRegistry | None = None, **cfg) -> Core:
    return Core("steps", BufferConfig(max_bytes=0, **cfg), registry)


def test_a_refused_entry_is_sent_again_after_a_wait_the_filed_ones_are_not():
    groups = [build_group(seed=i) for i in range(3)]
    steps = core().insert_steps(groups)
    first = next(steps)
    assert isinstance(first, SendChunk) and [e[0] for e in first.entries] == [g.group_id for g in groups]
    wait = steps.send(reply(1, 2, 0))  # inserted, refused by the ratio limiter, duplicate
    assert isinstance(wait, Wait) and wait.seconds == pytest.approx(0.005, abs=1e-3)
    again = steps.send(None)
    assert isinstance(again, SendChunk) and [e[0] for e in again.entries] == [groups[1].group_id]
    with pytest.raises(StopIteration) as done:
        steps.send(reply(1))
    inserted, dups, rejected = done.value.value
    assert inserted == [groups[0].group_id, groups[1].group_id] and dups == [groups[2].group_id]
    assert rejected == {}


def test_the_waits_double_and_the_limiter_ends_them_with_rate_limited():
    registry = CollectorRegistry()
    c = core(registry, insert_timeout_s=0.2, backoff_initial_s=0.01, backoff_max_s=0.04)
    steps = c.insert_steps([build_group()])
    next(steps)
    waits = []
    with pytest.raises(RateLimited, match=r"insert_timeout_s=0\.2 \(0 inserted"):
        while True:
            waits.append(steps.send(reply(2)))  # refused again: a wait
            time.sleep(waits[-1].seconds)  # what the sync shell does with it
            assert isinstance(steps.send(None), SendChunk)  # then the chunk goes again
    assert [w.seconds for w in waits[:3]] == pytest.approx([0.01, 0.02, 0.04])
    assert all(w.seconds <= 0.04 for w in waits)
    counted = registry.get_sample_value("offpolicy_buffer_rate_limited_waits_total", {"op": "insert"})
    assert counted == len(waits)


def test_over_max_bytes_raises_buffer_full_at_once_naming_what_went_in():
    groups = [build_group(seed=1), build_group(seed=2)]
    steps = core().insert_steps(groups)
    next(steps)
    with pytest.raises(BufferFull) as e:
        steps.send(reply(1, 3))
    assert e.value.inserted == (groups[0].group_id,)


def test_rejections_are_counted_first_and_maxmemory_read_once_without_max_bytes():
    bad = build_group(seed=3)
    bad.trajectories[0].reward = float("nan")
    c = Core("steps", BufferConfig(), None)  # max_bytes None: derived from Redis' maxmemory
    steps = c.insert_steps([bad, build_group(seed=4)])
    count = next(steps)
    assert isinstance(count, CountRejected) and count.counts == {"rejected:trajectories.reward": 1}
    assert isinstance(steps.send(None), ReadMaxmemory)
    chunk = steps.send(1000)
    assert isinstance(chunk, SendChunk) and chunk.max_bytes == c.max_bytes == int(
        1000 * c.cfg.max_bytes_share
    )
    with pytest.raises(StopIteration) as done:
        steps.send(reply(1))
    assert list(done.value.value[2]) == [bad.group_id]
    assert not isinstance(next(c.insert_steps([build_group(seed=5)])), ReadMaxmemory)  # read again in 30 s
