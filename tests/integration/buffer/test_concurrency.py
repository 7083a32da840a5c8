"""Many writers and readers at once: 8 producer processes and 2 consumers; and kill -9 mid-insert."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.errors import BufferNotReady, StorageUnavailable
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis
CTX = mp.get_context("fork")  # children reuse the imported modules; each opens its own connections
PRODUCERS, PER_PRODUCER = 8, 30
CONFIG = BufferConfig(sampler="uniform", max_times_sampled=2, max_staleness=2, max_size=100_000)


def _produce(url: str, run_id: str, seed: int, version, out) -> None:
    rng = np.random.default_rng(seed)
    acked = []
    with ReplayBuffer(url, run_id, CONFIG) as b:
        for i in range(PER_PRODUCER):
            g = build_group(
                max(0, version.value - int(rng.integers(0, 4))), n=2, tokens=8, seed=seed * 1000 + i
            )
            if b.insert(g):
                acked.append(g.group_id)
    out.put(acked)


def test_8_producers_2_consumers(redis_url, run_id) -> None:
    version = CTX.Value("i", 0)
    out = CTX.Queue()
    procs = [
        CTX.Process(target=_produce, args=(redis_url, run_id, s, version, out)) for s in range(PRODUCERS)
    ]
    for p in procs:
        p.start()
    samples: list[tuple[str, int, int]] = []  # (group_id, policy_version, consumer_version)
    lock = threading.Lock()
    done = threading.Event()

    def consume() -> None:
        with ReplayBuffer(redis_url, run_id, CONFIG) as b:
            while True:
                cv = version.value
                try:
                    got = b.sample(3, cv, timeout_s=0.3)
                except BufferNotReady:
                    if done.is_set():
                        return
                    continue
                with lock:
                    samples.extend((g.group_id, g.policy_version, cv) for g in got)
                    version.value += 1  # the learner stepped

    consumers = [threading.Thread(target=consume) for _ in range(2)]
    for t in consumers:
        t.start()
    acked = [gid for _ in procs for gid in out.get(timeout=60)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    done.set()
    for t in consumers:
        t.join(timeout=60)

    with ReplayBuffer(redis_url, run_id, CONFIG) as b:
        stats = b.stats()
        remaining = {k.decode() for k in b._client.zrange(BufferKeys.for_run(run_id).order, 0, -1)}
        b.clear()
    uses = Counter(gid for gid, _, _ in samples)
    assert len(acked) == len(set(acked)) == PRODUCERS * PER_PRODUCER == stats.inserted_total
    assert set(uses) <= set(acked) and remaining <= set(acked)
    assert max(uses.values()) <= CONFIG.max_times_sampled  # never over max_times_sampled
    assert all(cv - v <= CONFIG.max_staleness for _, v, cv in samples)  # never staler than max_staleness
    assert stats.sampled_total == len(samples)  # every sample handed out reached a consumer
    consumed = {gid for gid, n in uses.items() if n == CONFIG.max_times_sampled}
    assert not consumed & remaining
    assert stats.evicted_total.get("max_times_sampled", 0) == len(consumed)
    # no loss: each acknowledged group is consumed, still stored, or counted as dropped for staleness
    assert len(consumed) + len(remaining) + stats.dropped_total.get("stale", 0) == len(acked)


def _insert_until_down(url: str, run_id: str, seed: int, log: str) -> None:
    cfg = BufferConfig(storage_timeout_s=0.3, socket_timeout_s=0.5, max_times_sampled=None)
    with ReplayBuffer(url, run_id, cfg) as b, open(log, "a") as f:
        for i in range(100_000):
            g = build_group(0, n=2, tokens=64, seed=seed * 100_000 + i)
            try:
                b.insert(g)
            except StorageUnavailable:
                return
            f.write(g.group_id + "\n")  # acknowledged
            f.flush()


def test_kill_9_mid_insert_keeps_every_acknowledged_insert(tmp_path: Path, run_id: str) -> None:
    with EmbeddedRedis.start(tmp_path / "data", appendfsync="always") as server:
        logs = [str(tmp_path / f"acked-{i}.txt") for i in range(PRODUCERS)]
        procs = [
            CTX.Process(target=_insert_until_down, args=(server.url, run_id, i, logs[i])) for i in range(8)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 20
        while sum(Path(x).stat().st_size if Path(x).exists() else 0 for x in logs) < 200 * 33:
            assert time.monotonic() < deadline, "producers did not get going"
            time.sleep(0.05)
        server.kill()  # SIGKILL while 8 producers are inserting
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        server.restart()  # same data dir: replays the AOF
        acked = [line for x in logs for line in Path(x).read_text().split()]
        keys = BufferKeys.for_run(run_id)
        with redis.Redis.from_url(server.url) as c:
            stored = [k.decode() for k in c.zrange(keys.order, 0, -1)]
            inserted = int(c.hget(keys.counters, "inserted"))
            seen = c.zcard(keys.seen)
            payloads = [k.decode() for k in c.scan_iter(match=keys.payload_prefix + "*", count=1000)]
            out = list(c.scan_iter(match=keys.out_prefix + "*", count=1000))
            ttls = {c.pttl(keys.payload(gid)) for gid in stored}
        assert len(acked) >= 200
        # consistent: each insert (SET NXs + script) is one MULTI/EXEC, replayed all or nothing: no payload
        # key without its indexes (a refused SET NX's key is deleted in the same transaction)
        assert len(stored) == len(set(stored)) == inserted == seen
        assert sorted(payloads) == sorted(keys.payload(gid) for gid in stored) and ttls == {-1}
        assert out == []
        assert set(acked) <= set(stored)  # every insert that returned survived kill -9
        assert len(stored) - len(acked) <= PRODUCERS  # at most the one in flight per producer
        with ReplayBuffer(server.url, run_id) as b:
            retry = [dataclasses.replace(build_group(0), group_id=gid) for gid in acked[:8]]
            assert (
                len(b.insert_many(retry).duplicates) == 8
            )  # a retried insert stays a no-op after the restart
