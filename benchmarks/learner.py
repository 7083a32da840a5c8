"""Learner step time by critical-path phase, with publishing off the critical path, on a named shape.

Each run trains a Llama-shaped model with random weights (embedded Redis, `decoupled_token_is`, publish
every step) and reports, per phase, the median critical-path time of the measured steps. `publish` is the
part of publishing the step waits for (starting the host snapshot, and waiting for it before the next
optimizer step); the writes run on the background writer. Baseline in the same run: a synchronous publish
of the same weights (what the learner did before), timed on its own: `sync_publish_share` is the share of
a step it would take. Shapes:

    cpu-ref        hidden 512 x 8 layers, 16 rows x (64 + 128) tokens, fp32 (CPU)
    publish-heavy  hidden 1024 x 2 layers, vocab 65,536 (160M parameters), 4 rows x (16 + 32) tokens:
                   a CPU shape whose synchronous publish costs >= 1/3 of the step
    0.4b           hidden 1024 x 24 layers, vocab 32k, 128 rows x (256 + 768) tokens (CUDA)
    1.3b           hidden 1536 x 28 layers, vocab 152k (2 KV heads), 64 rows x (256 + 768) tokens (CUDA)
    longtail       packed micro-batches vs padded rows, one long-tailed batch (benchmarks/learner_longtail.py)
    longtail-1.3b  the long-tailed batch at full scale (155,661 tokens) on a Llama-shaped 1.78B (CUDA)
    longtail-4b    the same on a Qwen3-4B-shaped 4.03B (CUDA); both: benchmarks/learner_longtail.py
    longtail-moe   the same on a Qwen3-30B-A3B-shaped MoE stack (its hidden 2048, 128 experts of 768, top-8,
                   vocab 151,936) with as many layers as one 80 GiB GPU holds per the memory plan (5: 3.6B
                   parameters, 0.9B active; CUDA; refused on CPU but with --smoke)

Targets: publish-heavy: sync_publish_share >= 0.3, publish_share <= 0.05, published_lag_max <= 2;
cpu-ref: everything outside model work <= 5 % of the step; 1.3b with bf16_mixed: publish_share <= 0.05.
MFU (CUDA only) counts 6 N flops per trained token and 2 N per pi_old token, N the parameters a token is
multiplied by (the input embedding left out unless tied to the LM head; attention not counted): of a
mixture-of-experts model its active parameters, as prime-rl counts them (`get_active_mm_params`: top_k
routed experts, the shared ones and the router; learner_longtail.py `matmul_params`).

    python benchmarks/learner.py [--shape cpu-ref] [--device cpu] [--steps 3] [--precision P]
                                 [--packing on|off|both] [--json] [--smoke]
                                 [--attention K] [--logprob-head fused|chunked]
                                 [--gradient-checkpointing [on|off|auto]] [--checkpoint-layers K]
                                 [--micro-batch-tokens N|auto] [--no-grad-micro-batch-tokens N|auto]
                                 [--compile-layers [on|off|auto]] [--prefetch on|off]
                                 [--model-dir DIR] [--levers]
                                 [--lever-rows I,J,...] [--profile]

The lever flags apply to every shape; unset, each keeps the learner's default (`--gradient-checkpointing`
alone means on). `--levers` (longtail-1.3b, longtail-4b): one run per lever, each adding one lever to the
row before, from a baseline of `sdpa_varlen`, the chunked head, every layer checkpointed and 16,384
tokens; prints the table of docs/benchmarks.md (`--json`: `{"levers": [rows], "mfu", ...}`). `--profile`
(the same shapes): one more step under torch.profiler, its kernels' time by kind and the device's busy
share (`profile`; with `--levers`, the last row's; benchmarks/learner_profile.py).
`--smoke`: tiny sizes, one measured step, the same code path (seconds on CPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import get_args

import numpy as np
import torch

import learner_levers
import learner_longtail
import learner_profile
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.config import AttnImplementation, LearnerConfig, LogprobHead
from offpolicy.learner.metrics import PHASES
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.learner.trainer import Learner

MODEL_WORK = ("old_logprob", "forward_backward", "optimizer")
SHAPES = {  # model sizes, then the batch: groups x n rows of prompt + response tokens
    "cpu-ref": {
        "model": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376},
        "groups": 4, "n": 4, "prompt": 64, "resp": 128, "micro": 8,
    },
    "publish-heavy": {
        "model": {"hidden_size": 1024, "num_layers": 2, "num_heads": 16, "intermediate_size": 2816,
                  "vocab_size": 65536},
        "groups": 2, "n": 2, "prompt": 16, "resp": 32, "micro": 4,
    },
    "0.4b": {
        "model": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "intermediate_size": 2816,
                  "vocab_size": 32000, "dtype": "bfloat16"},
        "groups": 16, "n": 8, "prompt": 256, "resp": 768, "micro": 8,
    },
    "1.3b": {
        "model": {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
                  "intermediate_size": 8960, "vocab_size": 151936, "dtype": "bfloat16"},
        "groups": 8, "n": 8, "prompt": 256, "resp": 768, "micro": 4,
    },
}  # fmt: skip
PEAK_TFLOPS = learner_longtail.PEAK_TFLOPS
SMOKE = {
    "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "groups": 2, "n": 2, "prompt": 8, "resp": 16, "micro": 4,
}  # fmt: skip


def synthetic_groups(k: int, n: int, prompt_len: int, resp_len: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [
        TrajectoryGroup(
            group_id=uuid.uuid4().hex,
            prompt_id=f"p{i}",
            prompt_ids=rng.integers(4, vocab, prompt_len, dtype=np.int32),
            policy_version=0,
            actor_id="bench",
            created_at=time.time(),
            sampling=SamplingParams(temperature=1.0, max_tokens=resp_len),
            trajectories=[
                Trajectory(
                    response_ids=rng.integers(4, vocab, resp_len, dtype=np.int32),
                    behavior_logprobs=-(rng.random(resp_len, dtype=np.float32) * 4 + 2),
                    reward=float(rng.random()),
                    finish_reason="length",
                )
                for _ in range(n)
            ],
        )
        for i in range(k)
    ]


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory allocated (CUDA), or the process's peak resident set (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def sync_publish_seconds(learner: Learner, folder: Path, reps: int) -> float:
    """Median time of a synchronous publish (snapshot + write + hash + fsync + rename) of the same weights."""
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        publish_weights(learner.model, folder, 10_000 + i, tokenizer=learner.tokenizer,
                        dtype=learner.persist.publish_dtype, keep_versions=1)  # fmt: skip
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mfu(
    params: int, trained_tokens: int, old_tokens: int, step_s: float, device: torch.device
) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return (
        None
        if peak is None
        else (6 * params * trained_tokens + 2 * params * old_tokens) / step_s / (peak * 1e12)
    )


def run(args: argparse.Namespace, packing: bool = True) -> dict:
    shape = SMOKE if args.smoke else SHAPES[args.shape]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows, seq = shape["groups"] * shape["n"], shape["prompt"] + shape["resp"]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis.start(Path(tmp) / "redis") as redis:
        model_dir = make_tiny_model(
            Path(tmp) / "model", max_position_embeddings=max(1024, seq), **shape["model"]
        )
        cfg = LearnerConfig(
            model_path=str(model_dir), device=str(device), precision=args.precision, redis_url=redis.url,
            run_id="bench", groups_per_step=shape["groups"], micro_batch_size=shape["micro"], packing=packing,
            rollout_correction="decoupled_token_is",
            publish={"weights_dir": str(Path(tmp) / "w"), "publish_every": 1, "keep_versions": 2},
            checkpoint={"checkpoint_dir": None}, torch_threads=args.threads,
            **learner_longtail.lever_settings(args),
        )  # fmt: skip
        vocab = shape["model"].get("vocab_size", 101)
        with ReplayBuffer(redis.url, cfg.run_id, cfg.buffer) as buf:
            for i in range(args.steps + 1):
                groups = synthetic_groups(
                    shape["groups"], shape["n"], shape["prompt"], shape["resp"], vocab, i
                )
                buf.insert_many(groups)
        learner = Learner(cfg)
        try:
            learner.step()  # warm-up
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            runs = [learner.step() for _ in range(args.steps)]
            peak = peak_memory_gib(device)
            learner.writer.flush()
            sync_s = sync_publish_seconds(learner, Path(tmp) / "sync", args.sync_reps)
            params = sum(p.numel() for p in learner.model.parameters())
            flops_params = learner_longtail.matmul_params(learner.model)
            precision = learner.precision.name
        finally:
            learner.close()
    phases = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in runs) for p in PHASES}
    step = statistics.median(sum(r.get(f"time/{p}", 0.0) for p in PHASES) for r in runs)
    overhead = sum(v for p, v in phases.items() if p not in MODEL_WORK)
    tokens = rows * shape["resp"]
    return {
        "shape": args.shape + ("-smoke" if args.smoke else ""),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "precision": precision,
        "params": params,
        "rows_per_step": rows,
        "tokens_per_step": tokens,
        "step_s": step,
        "phases_s": phases,
        "publish_share": phases["publish"] / step,
        "sync_publish_s": sync_s,
        "sync_publish_share": sync_s / (step - phases["publish"] + sync_s),
        "published_lag_max": max(r["published_lag"] for r in runs),
        "overhead_share": overhead / step,
        "peak_memory_gib": peak,
        "tokens_per_s": tokens / step,
        "mfu": mfu(flops_params, rows * seq, rows * seq, step, device),
        "packing": packing,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[*sorted(SHAPES), "longtail", *learner_longtail.SHAPES],
                    default="cpu-ref")  # fmt: skip
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--precision", choices=["bf16_mixed", "fp32", "bf16_pure"], default=None,
                    help="default: bf16_mixed on CUDA, fp32 on CPU")  # fmt: skip
    ap.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const="on",
        choices=["on", "off", "auto"],
        help="activation checkpointing (alone: on; default: the learner's, auto on CUDA)",
    )
    ap.add_argument(
        "--attention",
        default=None,
        choices=get_args(AttnImplementation),
        help="attn_implementation (default: the learner's, auto)",
    )
    ap.add_argument(
        "--logprob-head",
        default=None,
        choices=get_args(LogprobHead),
        help="the LM head's log-probs: fused (default) or chunked (the earlier one)",
    )
    ap.add_argument(
        "--micro-batch-tokens",
        default=None,
        metavar="N|auto",
        help="micro_batch_tokens (default: the learner's, 16384)",
    )
    ap.add_argument(
        "--no-grad-micro-batch-tokens",
        default=None,
        metavar="N|auto",
        help="no_grad_micro_batch_tokens: pi_old's budget (default: micro_batch_tokens)",
    )
    ap.add_argument(
        "--checkpoint-layers",
        type=int,
        default=None,
        metavar="K",
        help="checkpoint_layers: how many decoder layers checkpointing recomputes (default: all under on, "
        "the plan's choice under auto)",
    )
    ap.add_argument(
        "--prefetch",
        choices=["on", "off"],
        default=None,
        help="prefetch: lease the next step's groups while a step trains (default: the learner's, on with "
        "CUDA)",
    )
    ap.add_argument(
        "--levers",
        action="store_true",
        help="longtail-1.3b|longtail-4b: one run per lever, each adding one to the row before (baseline: "
        "sdpa_varlen, chunked head, every layer checkpointed, 16,384 tokens), and the table of them",
    )
    ap.add_argument(
        "--lever-rows",
        type=lambda v: [int(i) for i in v.split(",")],
        default=None,
        metavar="I,J,...",
        help="with --levers: these rows alone (0 = the baseline), each with the levers of the rows before",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="longtail-1.3b|longtail-4b: one more step under torch.profiler, its device time by kind of "
        "kernel (with --levers: the last row's)",
    )
    ap.add_argument(
        "--compile-layers",
        nargs="?",
        const="on",
        choices=["on", "off", "auto"],
        default=None,
        help="compile_layers: torch.compile each decoder layer (alone: on; default: the learner's, auto: "
        "on for one CUDA process)",
    )
    ap.add_argument(
        "--model-dir",
        default=None,
        help="longtail-*: where the random model is written, and reused when it is there",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one measured step (CPU, seconds)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    ap.add_argument("--sync-reps", type=int, default=2, help="synchronous publishes timed for the baseline")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--packing", choices=["on", "off", "both"], default="on",
                    help="packed micro-batches (default), padded rows, or both in one run")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.sync_reps = 1, 1
    if args.shape.startswith("longtail"):
        full_scale = args.shape in learner_longtail.SHAPES
        if args.levers and full_scale:
            out = learner_levers.run_levers(args)
            print(json.dumps(out) if args.json else learner_levers.levers_table(out))
            if "profile" in out and not args.json:
                print(learner_profile.profile_lines(out["profile"]))
            return
        out = learner_longtail.run_shape(args) if full_scale else learner_longtail.run(args)
        print(json.dumps(out) if args.json else "\n".join(f"  {k:<28} {v}" for k, v in out.items()))
        return
    out = run(args, packing=args.packing != "off")
    if args.packing == "both":  # the same shape on padded rows, in the same run
        rows = run(args, packing=False)
        out["padded_rows"] = {k: rows[k] for k in ("step_s", "tokens_per_s", "mfu", "peak_memory_gib")}
    if out["shape"] in ("cpu-ref", "publish-heavy"):
        out["targets"] = {"publish_share": 0.05, "sync_publish_share_min": 0.3, "published_lag_max": 2,
                          "overhead_share": 0.05}  # fmt: skip
    if "--json" in sys.argv:
        print(json.dumps(out))
        return
    print(f"{out['shape']} on {out['device']} ({out['precision']}, {out['params'] / 1e6:.0f}M parameters): "
          f"{out['rows_per_step']} rows, {out['tokens_per_step']} response tokens per step")  # fmt: skip
    for p, v in out["phases_s"].items():
        print(f"  {p:<18} {v * 1000:9.1f} ms  {v / out['step_s']:6.1%}")
    print(f"  step               {out['step_s'] * 1000:9.1f} ms   {out['tokens_per_s']:.0f} tokens/s")
    print(f"  publish share      {out['publish_share']:6.1%} (a synchronous publish: "
          f"{out['sync_publish_s']:.2f} s, {out['sync_publish_share']:.1%} of a step)")  # fmt: skip
    print(f"  published lag max  {out['published_lag_max']:.0f} versions")
    print(f"  outside model work {out['overhead_share']:6.1%}")
    print(f"  peak memory        {out['peak_memory_gib']:.2f} GiB")
    if out["mfu"] is not None:
        print(f"  MFU                {out['mfu']:.1%}")
    if "padded_rows" in out:
        print(f"  padded rows        {out['padded_rows']}")


if __name__ == "__main__":
    main()
