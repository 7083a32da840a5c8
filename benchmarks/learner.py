"""Learner step time by phase on CPU for a small Llama (hidden 512, 8 layers), with the embedded Redis.

Baseline in the same run: the forward/backward + optimizer time (the work any trainer must do). Target:
everything else (sample wait, collate, old log-prob excluded as model work, publish) <= 10% of the step.
`old_logprob` is reported apart: it is a model forward (decoupled mode's pi_old), not overhead.

    python benchmarks/learner.py [--steps 3] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python benchmarks/learner.py` puts benchmarks/ first on sys.path, where buffer.py would shadow the
# package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import numpy as np  # noqa: E402

from buffer.embedded import EmbeddedRedis  # noqa: E402
from buffer.replay_buffer import ReplayBuffer  # noqa: E402
from buffer.types import SamplingParams, Trajectory, TrajectoryGroup  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.metrics import PHASES  # noqa: E402
from learner.model import make_tiny_model  # noqa: E402
from learner.train import Learner  # noqa: E402

MODEL_WORK = ("old_logprob", "forward_backward", "optimizer")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    ap.add_argument("--groups", type=int, default=4, help="groups per step")
    ap.add_argument("--n", type=int, default=4, help="completions per group")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--resp-len", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis.start(Path(tmp) / "redis") as redis:
        model_dir = make_tiny_model(Path(tmp) / "model", hidden_size=512, num_layers=8, num_heads=8,
                                    intermediate_size=1376)  # fmt: skip
        cfg = LearnerConfig(
            model_path=str(model_dir), device="cpu", redis_url=redis.url, run_id="bench",
            groups_per_step=args.groups, micro_batch_size=8, rollout_correction="decoupled_token_is",
            publish={"weights_dir": str(Path(tmp) / "w"), "publish_every": 1},
            checkpoint={"checkpoint_dir": None},
        )  # fmt: skip
        with ReplayBuffer(redis.url, cfg.run_id, cfg.buffer) as buf:
            buf.insert_many(
                synthetic_groups(
                    args.groups * (args.steps + 1), args.n, args.prompt_len, args.resp_len, 100, 0
                )
            )
        learner = Learner(cfg)
        try:
            learner.step()  # warm-up
            runs = [learner.step() for _ in range(args.steps)]
        finally:
            learner.close()
    phases = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in runs) for p in PHASES}
    total = sum(phases.values())
    overhead = sum(v for p, v in phases.items() if p not in MODEL_WORK)
    out = {
        "model": "llama hidden 512, 8 layers, fp32 CPU",
        "rows_per_step": args.groups * args.n,
        "tokens_per_step": args.groups * args.n * args.resp_len,
        "step_s": total,
        "phases_s": phases,
        "baseline_forward_backward_optimizer_s": phases["forward_backward"] + phases["optimizer"],
        "overhead_share": overhead / total,
        "overhead_target": 0.10,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['model']}: {out['rows_per_step']} rows x {args.resp_len} tokens per step")
    for p, v in phases.items():
        print(f"  {p:<18} {v * 1000:9.1f} ms  {v / total:6.1%}")
    print(f"  step               {total * 1000:9.1f} ms   {out['tokens_per_s']:.0f} tokens/s")
    print(f"  outside model work {overhead / total:6.1%} (target <= 10%)")


if __name__ == "__main__":
    main()
