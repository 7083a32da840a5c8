"""Benchmark compute_rollout_correction against verl 0.9.1's compute_rollout_correction_and_rejection_mask.

Median wall time and tokens/s (B*T / time) on CPU, for four configurations at two sizes, both
implementations in the same run on the same tensors. The baseline is verl's own function loaded from
the installed wheel (benchmarks/verl_oracle.py); without the wheel only our figures are printed.

    python benchmarks/correction.py [--json] [--repeats N] [--smoke]

`--smoke`: one tiny size (B=8, T=64), one repeat: the same calls in about a second (CI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from offpolicy.learner.correction import RolloutCorrectionConfig, compute_rollout_correction
from verl_oracle import load_verl

CONFIGS: dict[str, dict] = {
    "metrics-only": {},
    "token TIS": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "sequence TIS + batch-norm": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
    },
    "token TIS + token_k1,seq_max_k2": {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k1,seq_max_k2",
        "rollout_rs_threshold": "0.6_1.6,2.5",
    },
}
SIZES = [(64, 1024), (256, 2048)]
SMOKE = {"sizes": [(8, 64)], "repeats": 1}
"""`--smoke`'s defaults (flags given explicitly still win)."""


def make_batch(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(t // 4, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None] < lens[:, None]).float()
    rollout = -torch.rand(b, t, generator=gen) * 3
    return rollout + 0.3 * torch.randn(b, t, generator=gen), rollout, mask


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="tiny size, one repeat, same code (CI)")
    parser.set_defaults(sizes=SIZES)
    args = parser.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    oracle = load_verl()
    rows = []
    for b, t in args.sizes:
        train, rollout, mask = make_batch(b, t)
        for name, cfg in CONFIGS.items():
            config = RolloutCorrectionConfig(**cfg)
            inputs = (train, rollout, mask)
            ours = median_ms(lambda c=config, x=inputs: compute_rollout_correction(*x, c), args.repeats)
            verl = None
            if oracle is not None:
                fn = oracle.helper.compute_rollout_correction_and_rejection_mask
                kw = {"rollout_is": None, **cfg}
                verl = median_ms(lambda f=fn, x=inputs, kw=kw: f(*x, **kw), args.repeats)
            rows.append(
                {
                    "config": name,
                    "B": b,
                    "T": t,
                    "ours_ms": round(ours, 2),
                    "ours_tokens_per_s": round(b * t / ours * 1e3),
                    "verl_ms": None if verl is None else round(verl, 2),
                    "verl_tokens_per_s": None if verl is None else round(b * t / verl * 1e3),
                    "speedup": None if verl is None else round(verl / ours, 2),
                }
            )
    meta = {
        "torch_threads": torch.get_num_threads(),
        "baseline": "verl 0.9.1" if oracle else "none (verl missing)",
    }
    if args.json:
        print(json.dumps({"meta": meta, "results": rows}))
        return
    print(f"baseline: {meta['baseline']}, torch threads: {meta['torch_threads']}")
    print(f"{'config':34} {'B':>4} {'T':>5} {'ours ms':>9} {'ours tok/s':>12} {'verl ms':>9} {'speedup':>8}")
    for r in rows:
        print(
            f"{r['config']:34} {r['B']:>4} {r['T']:>5} {r['ours_ms']:>9.2f} {r['ours_tokens_per_s']:>12,} "
            f"{r['verl_ms'] or '-':>9} {r['speedup'] or '-':>8}"
        )


if __name__ == "__main__":
    main()
