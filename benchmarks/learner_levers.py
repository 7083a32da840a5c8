"""`benchmarks/learner.py --shape longtail-1.3b|longtail-4b --levers`: each speed lever's share of a learner
step, in one run on one device. `run_shape` (benchmarks/learner_longtail.py) runs once per row of `LEVERS`,
each row adding one lever to the row before, from a baseline of `sdpa_varlen`, the chunked head, every layer
checkpointed and 16,384 tokens; `levers_table` prints the rows as docs/benchmarks.md's table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from learner_longtail import run_shape

LEVERS = (  # cumulative: each row adds one lever to the row before (the flags of `lever_settings`)
    ("baseline", {"attention": "sdpa_varlen", "logprob_head": "chunked", "gradient_checkpointing": "on",
                  "micro_batch_tokens": "16384", "no_grad_micro_batch_tokens": None,
                  "compile_layers": False}),
    ("+ varlen attention (auto)", {"attention": None}),
    ("+ fused log-prob head", {"logprob_head": None}),
    ("+ checkpointing auto (per layer)", {"gradient_checkpointing": "auto"}),
    ("+ budgets auto (training, pi_old)",
     {"micro_batch_tokens": "auto", "no_grad_micro_batch_tokens": "auto"}),
    ("+ compiled layers", {"compile_layers": True}),
)  # fmt: skip
"""`--levers`: the rows of the per-lever table (docs/benchmarks.md), in one run on one device."""


def run_levers(args: argparse.Namespace) -> dict:
    """`run_shape` once per row of `LEVERS`, each adding one lever to the row before, on the same model
    and batch (the model written once, reused); a row that fails (out of memory, or any other error, its
    traceback on stderr) is reported, the next runs. CPU: the compiled row is left out (inductor's CPU
    build takes minutes; the GPU is what it is for). `args.lever_rows` (indices into `LEVERS`, None: all)
    runs some rows alone, each still with the levers of the rows before it. Each finished row is also
    printed to stderr as it ends (`lever row: {...}`), so a run stopped by a time limit keeps the rows it
    finished."""
    flags = argparse.Namespace(**vars(args))
    rows, device = [], args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda, profile = str(device).startswith("cuda"), None
    chosen = getattr(args, "lever_rows", None)
    runs = [i for i, lv in enumerate(LEVERS) if (cuda or lv[0] != "+ compiled layers")
            and (chosen is None or i in chosen)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        flags.model_dir = args.model_dir or str(Path(tmp) / "model")
        for i, (name, change) in enumerate(LEVERS):
            for k, v in change.items():
                setattr(flags, k, v)
            if i not in runs:
                continue
            flags.profile = bool(getattr(args, "profile", False)) and i == runs[-1]  # the last row's
            try:  # run_shape frees the device of an earlier row's learner before it builds its own
                out = run_shape(flags)
                rows.append({"lever": name} | {k: out[k] for k in LEVER_KEYS})
                profile = out.get("profile", profile)
            except torch.OutOfMemoryError as e:
                rows.append({"lever": name, "error": f"out of memory: {str(e)[:160]}"})
            except Exception as e:  # a row that breaks (a kernel, a compile) must not cost the rest
                traceback.print_exc(file=sys.stderr)
                rows.append({"lever": name, "error": f"{type(e).__name__}: {str(e)[:240]}"})
            print(f"lever row: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    done = [r for r in rows if "error" not in r]
    return {
        "shape": args.shape + ("-smoke" if args.smoke else ""),
        "device": done[0]["device"] if done else device,
        "levers": rows,
        "mfu": done[-1]["mfu"] if done else None,
        "speedup_vs_baseline": done[0]["step_s"] / done[-1]["step_s"] if len(done) > 1 else None,
    } | ({"profile": profile} if profile is not None else {})


LEVER_KEYS = ("device", "warmup_s", "step_s", "tokens_per_s", "mfu", "pi_old_s", "forward_backward_s",
              "optimizer_s", "peak_memory_gib", "resident_gib_at_start", "plan_gib", "attention",
              "settings")  # fmt: skip


def levers_table(out: dict) -> str:
    """The `--levers` rows as a markdown table (docs/benchmarks.md)."""
    lines = ["| lever | step s | real tokens/s | MFU | π_old s | fwd+bwd s | peak / plan GiB | first step s "
             "| settings |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in out["levers"]:
        if "error" in r:
            lines.append(f"| {r['lever']} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        s = r["settings"]
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        peak = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        lines.append(
            f"| {r['lever']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {mfu} | {r['pi_old_s']:.2f} | "
            f"{r['forward_backward_s']:.2f} | {peak} / {r['plan_gib']:.1f} | {r['warmup_s']:.1f} | "
            f"{r['attention']}, "
            f"{s['logprob_head']}, ckpt {s['checkpointed_layers']}/{s['decoder_layers']}, "
            f"{s['micro_batch_tokens']} / {s['no_grad_micro_batch_tokens']} tokens"
            f"{', compiled' if s['compile_layers'] else ''} |"
        )
    return "\n".join(lines)
