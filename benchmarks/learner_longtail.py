"""`benchmarks/learner.py --shape longtail`: packed micro-batches against today's padded rows, same groups.

One long-tailed RL batch (16 groups x 8 completions; prompts 150-350 tokens and responses lognormal with
median 630, mean 970, capped at 8,000, all scaled by 1/8 for the CPU model: hidden 256 x 4 layers) is
trained by two learners in the same run: `packing: false` (padded rows, `micro_batch_size` 8, today's
default) and `packing: true` (micro-batches of at most `micro_batch_tokens`, scaled like the lengths:
16,384 / 8). Each takes a warm-up step, then the measured steps on the same groups.

- `padded_token_share_rows` / `padded_token_share`: padding in the token slots of the forward passes
  (prompt + response columns of every micro-batch row, summed over micro-batches) / of the packed rows.
- `step_speedup_vs_rows`: median step time with rows over with packing.
- `logprob_max_abs_diff`: pi_old of the whole batch, packed vs padded, on the same weights (fp32).
- `lockstep_useful_share` (packed) and `..._rows` (today): for 8 ranks and the batch at full scale (64 x
  8 completions, 8k tokens at most), from the project's own split and plan code: the real tokens over
  8 x the sum over k of the slowest rank's k-th micro-batch (its token slots: padded or packed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.split import shares
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.policy import pack
from offpolicy.learner.rl.microbatches import (
    micro_batches,
    no_grad_logprobs,
    plan_micro_batches,
    rank_micro_batches,
)
from offpolicy.learner.trainer import Learner

SCALE = 8
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 688}
ROWS_MICRO, TOKEN_BUDGET = 8, 16384


def lengths(k: int, n: int, scale: int, seed: int) -> list[tuple[int, list[int]]]:
    """(prompt length, response lengths) of `k` groups of `n`: prompts 150-350, responses lognormal with
    median 630 and mean 970 (sigma = sqrt(2 ln(970/630))), at most 8,000; all divided by `scale`."""
    rng = np.random.default_rng(seed)
    sigma = float(np.sqrt(2 * np.log(970 / 630)))
    out = []
    for _ in range(k):
        prompt = int(rng.integers(150, 351))
        resp = np.minimum(rng.lognormal(np.log(630), sigma, n), 8000).astype(int)
        out.append((max(1, prompt // scale), [max(1, int(r) // scale) for r in resp]))
    return out


def longtail_groups(k: int, n: int, vocab: int, seed: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed + 1)
    return [
        TrajectoryGroup(
            group_id=uuid.uuid4().hex,
            prompt_id=f"p{i}",
            prompt_ids=rng.integers(4, vocab, p, dtype=np.int32),
            policy_version=0,
            actor_id="bench",
            created_at=time.time(),
            sampling=SamplingParams(temperature=1.0, max_tokens=max(rs)),
            trajectories=[
                Trajectory(
                    response_ids=rng.integers(4, vocab, r, dtype=np.int32),
                    behavior_logprobs=-(rng.random(r, dtype=np.float32) * 4 + 2),
                    reward=float(rng.random()),
                    finish_reason="length",
                )
                for r in rs
            ],
        )
        for i, (p, rs) in enumerate(lengths(k, n, SCALE, seed))
    ]


def slots(batch, rows: torch.Tensor | None) -> int:
    """Token slots of one padded micro-batch: rows x (the longest prompt + the longest response)."""
    if rows is None:
        return 0
    return int(batch.select(rows).attention_mask.numel())


def lockstep_shares(world: int = 8, seed: int = 7) -> tuple[float, float]:
    """(packed, rows) useful share of token-time for `world` ranks on the full-scale batch."""
    groups = []
    for g, (p, rs) in enumerate(lengths(64, 8, 1, seed)):
        groups.append(
            TrajectoryGroup(
                group_id=f"g{g}", prompt_id=f"p{g}", prompt_ids=np.full(p, 5, dtype=np.int32),
                policy_version=0, actor_id="bench", created_at=0.0,
                sampling=SamplingParams(temperature=1.0, max_tokens=8000),
                trajectories=[
                    Trajectory(response_ids=np.full(r, 6, dtype=np.int32),
                               behavior_logprobs=np.full(r, -1.0, dtype=np.float32), reward=0.0,
                               finish_reason="length")
                    for r in rs
                ],
            )
        )  # fmt: skip
    batch = collate(groups, pad_token_id=0)
    real = int(batch.attention_mask.sum())
    rows = torch.arange(batch.num_rows)
    parts = shares(rows, batch.group_index, batch.attention_mask.sum(-1), world)
    per_rank = [[slots(batch, mb) for mb in micro_batches(p, ROWS_MICRO)] for p in parts]
    k = max(len(c) for c in per_rank)
    rows_time = sum(max(c[j] if j < len(c) else 0 for c in per_rank) for j in range(k))
    seq = batch.attention_mask.sum(-1).tolist()
    plan = plan_micro_batches(seq, TOKEN_BUDGET, world)
    loads = [[sum(seq[i] for i in mb) for mb in rank] for rank in plan]  # [rank][k] tokens
    packed_time = sum(max(rank[j] for rank in loads) for j in range(len(loads[0])))
    return real / (world * packed_time), real / (world * rows_time)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or "cpu")
    packed_share, rows_share = lockstep_shares()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis.start(Path(tmp) / "redis") as redis:
        model_dir = make_tiny_model(Path(tmp) / "model", max_position_embeddings=2048, **MODEL)
        groups = longtail_groups(16, 8, 101, seed=0)
        results = {}
        for packing in (False, True):
            cfg = LearnerConfig(
                model_path=str(model_dir), device=str(device), precision=args.precision, redis_url=redis.url,
                run_id=f"longtail-{packing}", groups_per_step=16, packing=packing,
                micro_batch_size=ROWS_MICRO, micro_batch_tokens=TOKEN_BUDGET // SCALE,
                rollout_correction="decoupled_token_is",
                publish={"weights_dir": str(Path(tmp) / f"w{packing}")},
                checkpoint={"checkpoint_dir": None}, torch_threads=args.threads,
                buffer={"max_times_sampled": None},
            )  # fmt: skip
            with ReplayBuffer(redis.url, cfg.run_id, cfg.buffer) as buf:
                buf.insert_many(groups)
            learner = Learner(cfg)
            try:
                learner.step()  # warm-up
                steps = [learner.step() for _ in range(args.steps)]
                batch = collate(groups, learner.pad_id)
                old = no_grad_logprobs(learner.policy, batch, cfg, learner.precision)
                plan = rank_micro_batches(batch, torch.arange(batch.num_rows), cfg, learner.ranks)
                filled = [
                    pack(batch.select(r)).input_ids.numel() if packing else slots(batch, r) for r in plan
                ]
            finally:
                learner.close()
            step_s = statistics.median(sum(v for k, v in s.items() if k.startswith("time/")) for s in steps)
            real = int(batch.attention_mask.sum())
            results[packing] = {"step_s": step_s, "old": old, "padding": 1 - real / sum(filled), "real": real}
    rows, packed = results[False], results[True]
    return {
        "shape": "longtail",
        "device": str(device),
        "rows_per_step": 16 * 8,
        "tokens_per_step": rows["real"],
        "step_s_rows": rows["step_s"],
        "step_s_packed": packed["step_s"],
        "padded_token_share_rows": rows["padding"],
        "padded_token_share": packed["padding"],
        "step_speedup_vs_rows": rows["step_s"] / packed["step_s"],
        "logprob_max_abs_diff": float((rows["old"] - packed["old"]).abs().max()),
        "lockstep_useful_share": packed_share,
        "lockstep_useful_share_rows": rows_share,
        "targets": {
            "padded_token_share": 0.05,
            "step_speedup_vs_rows": 2.0,
            "logprob_max_abs_diff": 1e-5,
            "lockstep_useful_share": 0.9,
        },
    }
