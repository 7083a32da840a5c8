"""Producers follow the learner's buffer config: the learner publishes its table-wide fields
(`offpolicy:{run}:buf:config`, JSON) at start and after every applied `buffer` change; a producer's
inserts read them at most once a second (in the insert's own transaction) and adopt them, keeping their
local fields (timeouts, backoff, pacing)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from offpolicy.buffer.config import LOCAL_FIELDS, BufferConfig
from offpolicy.buffer.embedded import free_port
from offpolicy.buffer.errors import BufferFull
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer, ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.conftest import build_group
from tests.integration.services.test_learner import AUTH, TOKEN, random_group, tiny, wait_for  # noqa: F401

pytestmark = pytest.mark.redis


def test_table_fields_are_all_but_the_local_ones() -> None:
    local = BufferConfig(max_size=7, insert_timeout_s=1.5, max_ahead=3, socket_timeout_s=2.0)
    learner = BufferConfig.staleness_weighted(max_size=50, max_bytes=10_000, insert_timeout_s=99.0)
    merged = local.with_table(learner.table_json())
    assert (merged.max_size, merged.sampler, merged.max_staleness, merged.max_bytes) == (
        50,
        "staleness_weighted",
        4,
        10_000,
    )
    assert (merged.insert_timeout_s, merged.max_ahead, merged.socket_timeout_s) == (1.5, 3, 2.0)
    assert all(getattr(merged, f) == getattr(local, f) for f in LOCAL_FIELDS)
    assert all(
        getattr(merged, f) == getattr(learner, f) for f in BufferConfig.model_fields if f not in LOCAL_FIELDS
    )


def test_a_producer_adopts_the_published_table_within_a_second(redis_url, run_id, caplog) -> None:
    learner = ReplayBuffer(redis_url, run_id, BufferConfig(max_size=100), follow_learner=False)
    producer = ReplayBuffer(redis_url, run_id, BufferConfig(max_size=100, insert_timeout_s=2.5))
    loner = ReplayBuffer(redis_url, run_id, BufferConfig(max_size=100), follow_learner=False)
    try:
        learner.publish_table()
        producer.insert(build_group(0))  # reads the table (the same as its own)
        learner.reconfigure(BufferConfig(max_size=100, max_bytes=1))  # an empty buffer takes one group
        learner.publish_table()
        with caplog.at_level(logging.INFO, logger="offpolicy.buffer.core"):
            deadline = time.monotonic() + 3.0
            with pytest.raises(BufferFull):
                while time.monotonic() < deadline:
                    producer.insert(build_group(0))
                    time.sleep(0.05)
        assert producer.config.max_bytes == 1 and producer.config.insert_timeout_s == 2.5
        assert any("max_bytes=1" in r.getMessage() for r in caplog.records)
        assert loner.insert(build_group(0))  # follow_learner=False: its own config
        learner.reconfigure(BufferConfig(max_size=100, max_bytes=0))  # the learner lifts the bound again
        learner.publish_table()
        time.sleep(1.1)
        with pytest.raises(BufferFull):  # this insert reads the new table, still under the old one
            producer.insert(build_group(0))
        assert producer.insert(build_group(0)) and producer.config.max_bytes == 0
        # A table this producer cannot use is ignored (logged once), the config in force stays.
        producer._client.set(producer._core.keys.table, b'{"max_size": -1}')
        time.sleep(1.1)
        with caplog.at_level(logging.WARNING, logger="offpolicy.buffer.core"):
            assert producer.insert(build_group(0))
        assert producer.config.max_size == 100
        assert any("not valid here" in r.getMessage() for r in caplog.records)
    finally:
        learner.clear()
        for b in (learner, producer, loner):
            b.close()


@pytest.fixture
def learner_url(tiny: Path, redis_url: str, run_id: str, tmp_path: Path) -> Iterator[str]:  # noqa: F811
    config = LearnerConfig(
        model_path=str(tiny), device="cpu", redis_url=redis_url, run_id=run_id, groups_per_step=2,
        micro_batch_size=8, buffer=BufferConfig(max_times_sampled=1), sample_timeout_s=0.3,
        publish={"weights_dir": str(tmp_path / "weights")}, checkpoint={"checkpoint_dir": None},
    )  # fmt: skip
    app = create_app(LearnerServiceSettings(api_token=TOKEN), config=config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="learner-api")
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive())
        assert thread.is_alive(), "the learner service did not start"
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(60)


def test_a_patch_of_buffer_on_the_learner_reaches_the_actors_inserts(learner_url, redis_url, run_id) -> None:
    """A live learner service and an actor's buffer client: PATCH buffer.max_bytes on the learner, and
    the producer's inserts obey the new bound within a couple of seconds of the PATCH (they were
    unbounded before); the producer's local fields stay its own."""
    local = BufferConfig(max_times_sampled=1, insert_timeout_s=3.0, max_ahead=64)

    async def produce() -> tuple[float, BufferConfig]:
        async with AsyncReplayBuffer(redis_url, run_id, local) as producer:
            for i in range(6):  # the learner trains on these: nothing refused
                await producer.insert(random_group(0, i))
            with httpx.Client(base_url=learner_url, timeout=30) as http:
                r = http.patch("/v1/config", json={"buffer": {"max_bytes": 1}}, headers=AUTH)
                assert r.status_code == 202, r.text  # applied at the learner's next step boundary
                t0 = time.monotonic()
            i = 100
            while True:  # an empty buffer takes one group: from then on each insert is refused
                try:
                    await producer.insert(random_group(0, i))
                except BufferFull:
                    return time.monotonic() - t0, producer.config
                assert time.monotonic() - t0 < 5, "the producer did not obey the learner's max_bytes"
                i += 1
                await asyncio.sleep(0.05)

    seconds, adopted = asyncio.run(produce())
    assert (adopted.max_bytes, adopted.insert_timeout_s, adopted.max_ahead) == (1, 3.0, 64)
    print(f"adopted {seconds:.2f} s after the learner applied the change")
