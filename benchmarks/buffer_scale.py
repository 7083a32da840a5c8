"""`benchmarks/buffer.py --scale`: sample latency per sampler at 10^4, 10^5 and 10^6 stored groups, and
the longest Redis command (SLOWLOG) while sampling and inserting at each size.

The table is bulk-loaded with pipelined variadic writes (MSET of the payloads, ZADD of the indexes and
the dedupe window, 1000 groups per command, exactly what insert.lua would have stored) with small
payloads (1 completion of 4 tokens, ~200 bytes: the index sizes matter here, not the bytes), policy
versions 0..7 and random priorities. Then, at each size, per sampler (replay: `max_times_sampled` None, so
the size stays put): `sample(8)` `--scale-calls` times, p50/p99 ms; and, for the queue with leases,
`lease(8)` + `ack` of the 8 (`max_times_sampled` 1: the groups leave). Then 50 more calls of each with
the server's main-thread CPU time around every call (`INFO cpu`): its p50 and maximum per call, the
commands' own cost, which a descheduled server does not accumulate (on a shared host SLOWLOG's wall
clock also holds scheduler ticks), and the same for `insert_many` of 8 groups. SLOWLOG records every command
(threshold 0) while the samplers run, plus 8-group `insert_many` calls between them; the maximum is
reported per size (the target: no command over 10 ms at 10^6). The bulk load itself is not measured,
and each size first rewrites the AOF and waits for it (`settle`): otherwise the bulk load's AOF growth
triggers an automatic rewrite (a fork) during the measurement, and a busy disk delays writes behind a
slow fsync; both show as latency that is not the buffer's (counted: `forks_while_measuring`,
`aof_delayed_fsync`).
"""

from __future__ import annotations

import hashlib
import statistics
import time
import uuid

import numpy as np
import redis

from offpolicy.buffer.codec import encode_group
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.storage import script_source
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup

SIZES = (10_000, 100_000, 1_000_000)
SAMPLERS = ("fifo", "newest", "uniform", "staleness_weighted", "prioritized")
VERSIONS = 8  # policy versions 0..7; consumer at 7 with max_staleness 7: nothing is stale
CONSUMER_VERSION = VERSIONS - 1
_LOAD_CHUNK = 1000


def _group(version: int, seed: int) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    traj = Trajectory(
        rng.integers(0, 32000, 4, dtype=np.int32), -rng.random(4, dtype=np.float32), 1.0, "stop"
    )
    prompt = rng.integers(0, 32000, 8, dtype=np.int32)
    return TrajectoryGroup(
        uuid.uuid4().hex, "p", prompt, version, "bench", time.time(), SamplingParams(), [traj]
    )


def bulk_load(c: redis.Redis, keys: BufferKeys, count: int, rng: np.random.Generator) -> None:
    """Store `count` more groups as insert.lua would (payloads, order, version, priority, dedupe window,
    the `inserted` counter), ids and insert sequence numbers after those already used."""
    payloads = [encode_group(_group(v, v)) for v in range(VERSIONS)]  # one frame per version, reused
    now_ms = time.time() * 1000
    first = int(c.hget(keys.counters, "inserted") or 0)
    for lo in range(first, first + count, _LOAD_CHUNK):
        seqs = range(lo, min(lo + _LOAD_CHUNK, first + count))
        gids = [f"bulk{i:012d}" for i in seqs]
        versions = rng.integers(0, VERSIONS, len(seqs))
        prios = rng.random(len(seqs)) * 10
        pipe = c.pipeline(transaction=False)
        pipe.mset({keys.payload(g): payloads[v] for g, v in zip(gids, versions, strict=True)})
        pipe.zadd(keys.order, {g: i + 1 for g, i in zip(gids, seqs, strict=True)})
        pipe.zadd(keys.by_version, {g: int(v) for g, v in zip(gids, versions, strict=True)})
        pipe.zadd(keys.priority, {g: float(p) for g, p in zip(gids, prios, strict=True)})
        pipe.zadd(keys.seen, {g: now_ms + i / 1024 for g, i in zip(gids, seqs, strict=True)})
        pipe.execute()
    c.hset(keys.counters, "inserted", first + count)


def settle(c: redis.Redis, timeout_s: float = 600.0) -> float:
    """Rewrite the AOF now and wait for it, and for any pending fsync. The bulk load grew the AOF far
    past its last rewrite, so Redis would otherwise fork a rewrite in the middle of the measurement: the
    child competes for the CPU and every write after the fork copies its page, which shows as slow
    commands that have nothing to do with the buffer (`forks_while_measuring` counts them)."""
    t0 = time.perf_counter()
    if not c.info("persistence").get("aof_rewrite_in_progress"):  # else: wait for the running one
        c.bgrewriteaof()
    while time.perf_counter() - t0 < timeout_s:
        p = c.info("persistence")
        busy = p.get("aof_rewrite_in_progress") or p.get("aof_rewrite_scheduled")
        if not busy and not p.get("aof_pending_bio_fsync"):
            break
        time.sleep(0.2)
    time.sleep(1.5)  # one everysec fsync period
    return time.perf_counter() - t0


def _ms(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=100) if len(times) > 1 else times * 99
    return {"p50_ms": 1000 * statistics.median(times), "p99_ms": 1000 * q[98]}


def _time_calls(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _cpu_us(c: redis.Redis) -> float:
    """Redis main-thread CPU time so far, in us (it does not advance while the process is descheduled)."""
    cpu = c.info("cpu")
    return 1e6 * (float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"]))


def _cpu_per_call(c: redis.Redis, fn, calls: int) -> dict:
    """Server CPU time of each of `calls` calls of `fn` (INFO cpu before and after each, less the median
    cost of an empty pair of INFOs): p50 and max, in us. On a shared host this is the cost of the
    commands themselves, where SLOWLOG's wall-clock durations also hold the time the server spent
    descheduled (a 4 ms scheduler tick, or more, in the middle of any command)."""

    def deltas(f) -> list[float]:
        out = []
        for _ in range(calls):
            a = _cpu_us(c)
            f()
            out.append(_cpu_us(c) - a)
        return out

    base = statistics.median(deltas(lambda: None))
    d = sorted(x - base for x in deltas(fn))
    return {"cpu_p50_us": round(d[len(d) // 2]), "cpu_max_us": round(d[-1])}


def measure(url: str, run_id: str, size: int, calls: int) -> dict:
    """Per sampler p50/p99 of sample(8) (and lease+ack for the queue); the SLOWLOG maximum meanwhile."""
    rows: dict[str, dict] = {}
    with redis.Redis.from_url(url) as c:
        c.config_set("slowlog-log-slower-than", 0)
        c.config_set("slowlog-max-len", 200_000)
        c.slowlog_reset()
        for sampler in SAMPLERS:
            cfg = BufferConfig(sampler=sampler, max_times_sampled=None, max_size=size, max_staleness=VERSIONS)
            with ReplayBuffer(url, run_id, cfg) as b:
                rows[sampler] = _ms(_time_calls(lambda b=b: b.sample(8, CONSUMER_VERSION, 0), calls))
                rows[sampler] |= _cpu_per_call(
                    c, lambda b=b: b.sample(8, CONSUMER_VERSION, 0), min(calls, 50)
                )
                for _ in range(max(1, calls // 16)):  # 8-group inserts, evicting as many (max_size = size)
                    b.insert_many([_group(v, v) for v in range(VERSIONS)])
        cfg = BufferConfig.queue(max_size=size)
        with ReplayBuffer(url, run_id, cfg) as b:

            def lease_ack() -> None:
                leased = b.lease(8, CONSUMER_VERSION, 0, consumer="bench", lease_s=60)
                b.ack("bench", leased.lease_ids)

            rows["fifo lease+ack"] = _ms(_time_calls(lease_ack, calls))
            rows["fifo lease+ack"] |= _cpu_per_call(c, lease_ack, min(calls, 50))
            rows["insert_many(8)"] = _cpu_per_call(
                c, lambda: b.insert_many([_group(v, v) for v in range(VERSIONS)]), min(calls, 50)
            )
        log = c.slowlog_get(200_000)
        c.config_set("slowlog-log-slower-than", 10_000)
        c.config_set("slowlog-max-len", 128)
        worst = max(log, key=lambda e: e["duration"]) if log else None
    by_name: dict[str, list[int]] = {}
    for e in log:
        by_name.setdefault(_name(e["command"]), []).append(e["duration"])
    return {
        "size": size,
        "samplers": rows,
        "slowlog_entries": len(log),
        "slowlog_max_us": worst["duration"] if worst else 0,
        "slowlog_max_command": _name(worst["command"]) if worst else "",
        "slowlog_by_command": {name: _us(d) for name, d in sorted(by_name.items()) if name[0] in "EMUZ"},
    }


_SCRIPTS = {hashlib.sha1(script_source(n).encode()).hexdigest(): n for n in ("insert", "sample", "lease")}


def _name(command: bytes) -> str:
    """A SLOWLOG command: its name; EVALSHA as its script's name and op (sampler, lease op)."""
    parts = command.split(b" ")
    if parts[0].upper() == b"EVALSHA" and len(parts) > 1:
        script = _SCRIPTS.get(parts[1].decode(), parts[1].decode())
        detail = {"sample": 18, "lease": 14}.get(script)  # ARGV[5] (sampler), ARGV[1] (op): after 11 keys
        extra = f" {parts[detail].decode()}" if detail is not None and len(parts) > detail else ""
        if script == "sample" and len(parts) > 27 and parts[27]:  # ARGV[14], the consumer: a lease
            extra += " (lease)"
        return f"EVALSHA {script}.lua{extra}"
    return parts[0].upper().decode(errors="replace")


def _us(durations: list[int]) -> dict:
    """count, p50, p99 and max of SLOWLOG durations (us)."""
    d = sorted(durations)
    return {
        "n": len(d),
        "p50_us": d[len(d) // 2],
        "p99_us": d[min(len(d) - 1, len(d) * 99 // 100)],
        "max_us": d[-1],
    }


def run_scale(url: str, calls: int, sizes: tuple[int, ...] = SIZES) -> list[dict]:
    """Load the table up to each size in turn and measure there."""
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    keys = BufferKeys.for_run(run_id)
    rng = np.random.default_rng(0)
    rows = []
    with redis.Redis.from_url(url) as c:
        for size in sizes:
            t0 = time.perf_counter()
            bulk_load(c, keys, size - c.zcard(keys.order), rng)  # top up (lease+ack removed some)
            load_s = time.perf_counter() - t0
            settle_s = settle(c)
            delayed = c.info("persistence").get("aof_delayed_fsync", 0)
            forks = c.info("stats").get("total_forks", 0)
            row = measure(url, run_id, size, calls)
            row["load_s"], row["settle_s"] = load_s, settle_s
            row["aof_delayed_fsync"] = c.info("persistence").get("aof_delayed_fsync", 0) - delayed
            row["forks_while_measuring"] = c.info("stats").get("total_forks", 0) - forks
            row["used_memory_mb"] = c.info("memory")["used_memory"] / 2**20
            rows.append(row)
    return rows


def print_scale(rows: list[dict]) -> None:
    print(f"{'groups':>9} {'call':>19} {'p50 ms':>8} {'p99 ms':>8} {'server CPU p50/max us':>22}")
    for r in rows:
        for name, t in r["samplers"].items():
            lat = f"{t['p50_ms']:>8.3f} {t['p99_ms']:>8.3f}" if "p50_ms" in t else f"{'':>8} {'':>8}"
            print(f"{r['size']:>9} {name:>19} {lat} {t['cpu_p50_us']:>10}/{t['cpu_max_us']:<10}")
        print(
            f"{r['size']:>9} SLOWLOG max {r['slowlog_max_us'] / 1000:.2f} ms over {r['slowlog_entries']} "
            f"commands ({r['slowlog_max_command']!r}); load {r['load_s']:.1f} s, "
            f"Redis used memory {r['used_memory_mb']:.0f} MB, AOF fsyncs delayed while measuring "
            f"{r['aof_delayed_fsync']}, forks while measuring {r['forks_while_measuring']}"
        )
        for name, d in r["slowlog_by_command"].items():
            if name.startswith(("EVALSHA", "EXEC")):
                print(f"{'':>9}   {name:<38} n={d['n']:<5} p50 {d['p50_us']:>5} us  p99 {d['p99_us']:>6} us  "
                      f"max {d['max_us']:>6} us")  # fmt: skip
