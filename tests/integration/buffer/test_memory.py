"""A Redis with a small `maxmemory` and producers that never stop: the learner keeps training at its pace,
every acknowledged group is trained once and on a metrics line; producers wait (BufferFull), never fail.

On main before the byte budget (embedded Redis, `maxmemory 6mb`, `noeviction`) the producers filled Redis
to its maxmemory, their inserts failed as `StorageUnavailable`, the learner's own leases and policy record
failed with OOM (`waiting_for_redis`), and steps whose background publish failed lost their metrics line.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.errors import StorageUnavailable
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, covering_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis
PAD = 24_000  # metadata bytes per group: ~25 kB payloads, few tokens to train on
MAXMEMORY = 6 * 1024 * 1024


@pytest.fixture
def small_redis(tmp_path):
    """A Redis of its own with `maxmemory 6mb`, `noeviction` (the shipped policy, at a small size)."""
    with EmbeddedRedis.start(tmp_path / "redis") as server:
        with redis.Redis.from_url(server.url) as c:
            c.config_set("maxmemory", MAXMEMORY)
            c.config_set("maxmemory-policy", "noeviction")
        yield server


def padded(k: int, seed: int) -> list:
    """`k` trainable groups of the tiny model, each carrying PAD bytes of metadata."""
    groups = covering_groups(k, seed=seed, n=2, tokens=4)
    for g in groups:
        g.metadata["pad"] = uuid.uuid4().hex * (PAD // 32)
    return groups


def produce(url: str, run_id: str, cfg_json: str, stop_file: str, out: str) -> None:
    """A producer process (an actor's pusher): two tasks pushing 4-group batches as fast as they can
    until `stop_file` exists; then its metrics go to `out` as JSON."""
    from offpolicy.actors.config import RetryConfig
    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.actors.rollout.submit import push_groups
    from offpolicy.buffer.replay_buffer import AsyncReplayBuffer

    registry, stop = CollectorRegistry(), threading.Event()
    metrics, retry = ActorMetrics(registry), RetryConfig(initial_s=0.02, max_s=0.2)

    async def one(buf: AsyncReplayBuffer, seed: int) -> None:
        while not stop.is_set():
            await push_groups(buf, padded(4, seed), retry, metrics, stop)
            seed += 2
            stop.set() if Path(stop_file).exists() else None

    async def main() -> None:
        async with AsyncReplayBuffer(
            url, run_id, BufferConfig.model_validate_json(cfg_json), registry
        ) as buf:
            await asyncio.gather(one(buf, 0), one(buf, 1))

    asyncio.run(main())
    value = registry.get_sample_value
    Path(out).write_text(json.dumps({
        "buffer_full_wait_s": value("offpolicy_actor_buffer_wait_seconds_total", {"reason": "buffer_full"}),
        "redis_unavailable": value("offpolicy_actor_failures_total", {"reason": "redis_unavailable"}),
        "dropped_on_stop": value("offpolicy_actor_failures_total", {"reason": "dropped_on_stop"}),
        "pushed": value("offpolicy_actor_groups_pushed_total"),
    }))  # fmt: skip


def _steps(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _watch(learner: Learner, trainer: threading.Thread, seconds: float, troubles: set) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if learner.retrying is not None:
            troubles.add(learner.retrying[:160])
        assert trainer.is_alive(), "the learner loop died"
        time.sleep(0.05)


@pytest.mark.slow
def test_producers_that_never_stop_do_not_jam_the_learner(small_redis, tiny_dir, tmp_path):  # noqa: F811
    steps_file = tmp_path / "metrics.jsonl"
    cfg = config(
        tiny_dir, small_redis.url, tmp_path, groups_per_step=4, micro_batch_size=8, sample_timeout_s=2.0,
        buffer={"sampler": "fifo", "max_times_sampled": 1, "max_size": 100_000},
        checkpoint={"checkpoint_dir": None}, metrics_jsonl=str(steps_file),
    )  # fmt: skip
    with ReplayBuffer(small_redis.url, cfg.run_id, cfg.buffer) as buf:  # the baseline's data: 32 steps
        for i in range(32):
            buf.insert_many(padded(4, 1000 + i))
    keys = BufferKeys.for_run(cfg.run_id)
    learner = Learner(cfg)
    stop_learner, troubles = threading.Event(), set()
    trainer = threading.Thread(target=learner.run, args=(stop_learner,), daemon=True)
    trainer.start()
    while len(_steps(steps_file)) < 2:  # warm: the first steps pay for start-up
        time.sleep(0.05)
    # 1. The baseline: the learner alone on a filled buffer, 12 steps (or 6 s) of the 30 left: it
    # measures training, never waiting for groups, however fast the machine is.
    n0, t0 = len(_steps(steps_file)), time.monotonic()
    while len(_steps(steps_file)) < n0 + 12 and time.monotonic() - t0 < 6.0:
        _watch(learner, trainer, 0.05, troubles)
    baseline = (len(_steps(steps_file)) - n0) / (time.monotonic() - t0)
    assert len(_steps(steps_file)) < 32, "the baseline ran out of groups: it measured waiting"
    # 2. Producers that never stop, in their own process (as actors are).
    stop_file, out = tmp_path / "stop", tmp_path / "producer.json"
    args = (small_redis.url, cfg.run_id, cfg.buffer.model_dump_json(), str(stop_file), str(out))
    producer = multiprocessing.get_context("spawn").Process(target=produce, args=args, daemon=True)
    producer.start()
    try:
        budget = int(BufferConfig().max_bytes_share * MAXMEMORY)
        with redis.Redis.from_url(small_redis.url) as c:  # the producers fill the buffer to its budget
            while int(c.hget(keys.counters, "bytes") or 0) < budget - 4 * (PAD + 2000):
                assert producer.is_alive(), "the producer process died"
                time.sleep(0.1)
        n1, t1 = len(_steps(steps_file)), time.monotonic()
        _watch(learner, trainer, 12.0, troubles)
        flooded = (len(_steps(steps_file)) - n1) / (time.monotonic() - t1)
    finally:
        stop_file.touch()
        producer.join(30)
        stop_learner.set()
        trainer.join(30)
        learner.close()
    lines = _steps(steps_file)
    trained = [gid for line in lines for gid in line.get("group_ids", [])]
    with redis.Redis.from_url(small_redis.url, decode_responses=True) as c:
        inserted = set(c.zrange(keys.seen, 0, -1))
        stored = set(c.zrange(keys.order, 0, -1)) | set(c.hkeys(keys.held))
        acked = int(c.hget(keys.counters, "acked") or 0)
        used = c.info("memory")["used_memory"]
    produced = json.loads(out.read_text())
    print(f"baseline {baseline:.2f} steps/s, flooded {flooded:.2f}; producer {produced}; used {used}",
          file=sys.stderr)  # fmt: skip
    assert troubles == set(), f"the learner waited for Redis: {sorted(troubles)[:3]}"
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert inserted - stored == set(trained), "an acknowledged group is missing from metrics.jsonl"
    assert acked == len(trained)
    assert flooded >= 0.5 * baseline, f"{flooded:.2f} steps/s with producers, {baseline:.2f} without"
    assert produced["buffer_full_wait_s"] > 0, "the producers never had to wait"
    assert produced["redis_unavailable"] == 0, "a full buffer was reported as an outage"
    assert produced["pushed"] > 48


def test_a_step_whose_publish_fails_after_the_update_still_has_its_line(tiny_dir, redis_url, tmp_path):  # noqa: F811
    """The update is applied and its groups acknowledged, then the policy-record write fails (Redis OOM):
    the step's metrics line and Prometheus record are written all the same, before the error surfaces."""
    steps_file, registry = tmp_path / "metrics.jsonl", CollectorRegistry()
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, checkpoint={"checkpoint_dir": None},
        metrics_jsonl=str(steps_file),
    )  # fmt: skip
    groups = covering_groups(4, seed=3, n=2, tokens=4)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg, registry)
    try:

        def oom(*_a, **_k) -> None:
            raise StorageUnavailable("policy record failed: OutOfMemoryError: OOM command not allowed")

        learner.persist.publish = oom
        with pytest.raises(StorageUnavailable, match="OOM"):
            learner.step()
        lines = _steps(steps_file)
        assert [line["step"] for line in lines] == [1]
        assert len(lines[0]["group_ids"]) == 2 and set(lines[0]["group_ids"]) <= {g.group_id for g in groups}
        assert registry.get_sample_value("offpolicy_learner_steps_total") == 1.0
        assert registry.get_sample_value("offpolicy_learner_groups_total") == 2.0
    finally:
        learner.close()
