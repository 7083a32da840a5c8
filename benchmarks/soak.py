"""Soak: the quickstart's stack (embedded Redis, learner and actor services) run for minutes; is anything
growing? Samples Redis `used_memory` and key count, and the learner process's resident set, every
`--every` seconds; after a warm-up (the first `--warmup` share of the run) each must stay within 10 % of
its mean right after the warm-up. Keys are split: one payload key per stored group (bounded by
`max_size`; their number moves with the buffer's fill, and the total key count with it) and the rest
(indexes, dedupe, leases, the policy record), whose count is the one that must stay flat; payload keys
must never outnumber the stored groups (orphaned payloads). The buffer's dedupe set is bounded by a
window of ids (default 100,000, ~10 MB of Redis): it grows until full, by design; the soak uses a 500-id
window so that it fills during the warm-up (`--dedupe-window`). CI runs `--smoke` only (the run: 10 min).

    python benchmarks/soak.py [--minutes 10] [--every 10] [--warmup 0.2] [--json] [--smoke]

`--smoke`: the same stack and samples for 6 seconds, one sample a second (CI: checks it runs, not leaks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import redis
import yaml

from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.keys import BufferKeys
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.children import start_service
from offpolicy.services.quickstart.configs import actor_config, learner_config

TARGET_GROWTH = 0.10
SMOKE = {"minutes": 0.1, "every": 1.0}
"""`--smoke`'s defaults (flags given explicitly still win)."""


def rss_bytes(pid: int) -> int:
    """Resident set of a process (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


LEAK_KEYS = ("redis_used_memory_growth", "bookkeeping_keys_growth", "learner_rss_growth")


def held(stats: dict) -> int:
    """Groups whose payload is in Redis: stored, and leased (a leased payload stays until acked)."""
    return int(stats["size"]) + int(stats["leases_outstanding"])


def growth(samples: list[dict], key: str, warmup_end: float) -> float:
    """Mean of the last 20 % of the samples over the mean of the 20 % right after the warm-up, minus 1
    (means, since the buffer's fill, and so its key count, moves from one sample to the next)."""
    after = [s for s in samples if s["t"] >= warmup_end]
    n = max(1, len(samples) // 5)
    base, tail = after[:n], samples[-n:]
    return statistics.mean(s[key] for s in tail) / max(statistics.mean(s[key] for s in base), 1) - 1.0


def soak(minutes: float, every: float, warmup: float, dedupe_window: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        with EmbeddedRedis.start(run_dir / "redis") as server:
            model = str(make_tiny_model(run_dir / "model"))
            dataset = write_target_token_dataset(run_dir / "dataset.jsonl")
            lcfg = learner_config(run_dir, model, server.url, "soak")
            lcfg["checkpoint"]["checkpoint_every"] = 5
            groups_per_step = int(lcfg.get("groups_per_step", 1))
            lcfg["metrics_jsonl"] = None
            lcfg["buffer"]["dedupe_window"] = dedupe_window
            acfg = actor_config(model, dataset, server.url, "soak")
            acfg["buffer"]["dedupe_window"] = dedupe_window
            (run_dir / "learner.yaml").write_text(yaml.safe_dump(lcfg))
            (run_dir / "actor.yaml").write_text(yaml.safe_dump(acfg))
            learner = start_service("learner", run_dir / "learner.yaml", run_dir / "learner.log")
            actor = start_service("actor", run_dir / "actor.yaml", run_dir / "actor.log")
            client = redis.Redis.from_url(server.url)
            payload_pattern = BufferKeys.for_run("soak").payload_prefix + "*"
            samples: list[dict] = []
            try:
                learner.wait_ready(180)
                actor.wait_ready(300)
                t0 = time.monotonic()
                while time.monotonic() - t0 < minutes * 60:
                    for child in (learner, actor):
                        if child.proc.poll() is not None:
                            raise RuntimeError(f"{child.name} exited:\n{child.log_tail()}")
                    status = httpx.get(f"{learner.url}/v1/status", timeout=10).json()
                    memory = client.info("memory")
                    keys = int(client.dbsize())
                    payloads = sum(1 for _ in client.scan_iter(match=payload_pattern, count=1000))
                    samples.append({
                        "t": time.monotonic() - t0,
                        "redis_used_memory": int(memory["used_memory"]),
                        "redis_dataset": int(memory.get("used_memory_dataset", 0)),
                        "redis_overhead": int(memory.get("used_memory_overhead", 0)),
                        "redis_scripts": int(memory.get("used_memory_scripts", 0)),
                        "redis_keys": keys,
                        "payload_keys": payloads,  # one per stored group: bounded by max_size
                        "bookkeeping_keys": keys - payloads,  # indexes, dedupe, leases, policy record...
                        "stored_groups": held(status["buffer"]),
                        "dedupe_entries": int(client.zcard(BufferKeys.for_run("soak").seen)),
                        "learner_rss": rss_bytes(learner.proc.pid),
                        "step": int(status.get("step", 0)),
                    })  # fmt: skip
                    time.sleep(every)
                memory = client.info("memory")
                breakdown = {k: int(memory[k]) for k in ("used_memory_dataset", "used_memory_overhead",
                                                         "used_memory_scripts") if k in memory}  # fmt: skip
                biggest = sorted(
                    ((k.decode(), int(client.memory_usage(k) or 0)) for k in client.scan_iter(count=1000)),
                    key=lambda kv: -kv[1],
                )[:8]
            finally:
                actor.stop()
                learner.stop()
                client.close()
    warmup_end = warmup * minutes * 60
    out = {
        "minutes": minutes,
        "dedupe_window": dedupe_window,
        "samples": len(samples),
        "steps": samples[-1]["step"] - next(s["step"] for s in samples if s["t"] >= warmup_end),
        "redis_used_memory_growth": growth(samples, "redis_used_memory", warmup_end),
        "redis_dataset_growth": growth(samples, "redis_dataset", warmup_end),
        "redis_overhead_growth": growth(samples, "redis_overhead", warmup_end),
        "redis_scripts_growth": growth(samples, "redis_scripts", warmup_end),
        "redis_keys_growth": growth(samples, "redis_keys", warmup_end),
        "bookkeeping_keys_growth": growth(samples, "bookkeeping_keys", warmup_end),
        "stored_groups_growth": growth(samples, "stored_groups", warmup_end),
        "payload_keys_over_stored_max": max(s["payload_keys"] - s["stored_groups"] for s in samples),
        "learner_rss_growth": growth(samples, "learner_rss", warmup_end),
        "target_growth_max": TARGET_GROWTH,
        "memory_at_end": breakdown,
        "largest_keys_at_end": biggest,
        "first": samples[0],
        "last": samples[-1],
    }
    # A leak is memory or keys that nothing bounds: the payload keys are the stored groups (bounded by
    # max_size; their number moves with the buffer's fill, as does the total key count), so the key test
    # is on the other keys, and payload keys must never outnumber the stored groups (orphans).
    # the key scan and the status call are not atomic: a step may ack (remove) its groups between them
    out["orphan_tolerance"] = 2 * groups_per_step
    out["ok"] = all(out[k] < TARGET_GROWTH for k in LEAK_KEYS) and (
        out["payload_keys_over_stored_max"] <= out["orphan_tolerance"]
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the run before the baseline sample")
    ap.add_argument("--dedupe-window", type=int, default=500,
                    help="the dedupe window (ids): small enough to fill during the warm-up")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="6 seconds, one sample a second (CI)")
    args = ap.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    out = soak(args.minutes, args.every, args.warmup, args.dedupe_window)
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"soak {args.minutes:.0f} min, {out['samples']} samples, {out['steps']} learner steps after warm-up"
    )
    for key in ("redis_used_memory_growth", "bookkeeping_keys_growth", "learner_rss_growth"):
        print(f"  {key:<26} {out[key]:+7.1%}  (target < {TARGET_GROWTH:.0%})")
    print(
        f"  redis_keys_growth          {out['redis_keys_growth']:+7.1%}  (stored groups "
        f"{out['stored_groups_growth']:+.1%}; payload keys over stored groups, max: "
        f"{out['payload_keys_over_stored_max']})"
    )
    print("  ok" if out["ok"] else "  NOT ok")


if __name__ == "__main__":
    main()
