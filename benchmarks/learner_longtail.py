"""`benchmarks/learner.py --shape longtail[-1.3b|-4b]`: one long-tailed RL batch through the learner.

`--shape longtail` (CPU): packed micro-batches against the padded rows, same groups.

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

`--shape longtail-1.3b | longtail-4b | longtail-moe` (CUDA): the batch at full scale (155,661 real tokens)
on a random Llama-shaped 1.78B (hidden 1536 x 28, 12 heads, 2 KV heads, vocabulary 151,936), a
Qwen3-4B-shaped 4.03B (hidden 2560 x 36, 32 heads of 128, 8 KV heads, tied embeddings) or a
Qwen3-30B-A3B-shaped MoE stack (transformers' Qwen3MoE: hidden 2048, 32 heads of 128, 4 KV heads, 128
experts of width 768, top-8, untied vocabulary 151,936) with as many decoder layers as one process fits in
90 % of an 80 GiB GPU per the memory plan (`moe_layers_that_fit`: 5; the smoke run: 4 experts of 32,
top-2), `decoupled_token_is`, no publishing or checkpoints during the measured steps. Each lever is a
flag, so one run measures each one's share: `--attention`, `--logprob-head`, `--gradient-checkpointing
on|off|auto`, `--micro-batch-tokens N|auto`, `--no-grad-micro-batch-tokens N|auto` (their defaults: the
learner's). It reports the median step, its phases (pi_old, forward+backward, optimizer), real tokens/s,
MFU (8 N FLOPs per real token: forward, backward and the pi_old forward; no recompute, no attention; N =
`matmul_params`, the input embedding left out unless tied to the LM head, a MoE model's active parameters
as prime-rl counts them) against the dense bf16 peak, the peak device memory, the memory plan, the
attention kernel and the settings the learner chose; with `--profile`, one more step's device time by kind
of kernel (benchmarks/learner_profile.py). `--smoke`: the same path on a hidden-64 model and the batch's
lengths / 64 (seconds on CPU).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from learner_profile import profile_step
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.split import shares
from offpolicy.learner.metrics import PHASES
from offpolicy.learner.model import build_char_tokenizer, make_tiny_model
from offpolicy.learner.model.policy import pack
from offpolicy.learner.plan.memory import GIB, HEADROOM, ModelShape, estimate
from offpolicy.learner.plan.shape import count
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
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16
SHAPES = {  # the model shapes of the full-scale batch: architecture, then its config
    "longtail-1.3b": (LlamaConfig, {
        "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "head_dim": 128, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": False,
    }),
    "longtail-4b": (Qwen3Config, {
        "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True,
    }),
}  # fmt: skip
QWEN3_30B_A3B = {  # Qwen3-30B-A3B's layer (deploy/models/qwen3-30b-a3b/config.json), fewer of them
    "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
    "model_type": "qwen3_moe", "max_position_embeddings": 16384,
}  # fmt: skip
MOE_GPU_GIB = 80  # the smallest GPU the shape is for (H100 80 GB; an H200's 141 GB holds it with room)


def moe_layers_that_fit(gpu_gib: float = MOE_GPU_GIB) -> int:
    """The most Qwen3-30B-A3B decoder layers one process trains within 90 % of `gpu_gib` per the memory plan
    (learner/plan/memory.py: bf16_mixed, every layer checkpointed, 16,384-token micro-batches, its every
    expert's fp32 masters, gradients, AdamW moments and bf16 copies: ~11 GB a layer)."""
    config = LearnerConfig(model_path="unused", micro_batch_tokens=16384, compile_layers=False)
    limit = HEADROOM * gpu_gib * GIB

    def fits(layers: int) -> bool:
        shape = ModelShape.of_dict(QWEN3_30B_A3B | {"num_hidden_layers": layers})
        return estimate(config, shape, 1, False, True, cuda=True).total <= limit

    return max(n for n in range(1, 49) if fits(n))


SHAPES["longtail-moe"] = (Qwen3MoeConfig, {
    k: v for k, v in QWEN3_30B_A3B.items() if k not in ("model_type", "max_position_embeddings")
} | {"num_hidden_layers": moe_layers_that_fit()})  # fmt: skip
MOE_SMOKE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
SMOKE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 32, "intermediate_size": 128, "vocab_size": 512}  # fmt: skip
SMOKE_SCALE = 64


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


def longtail_groups(k: int, n: int, vocab: int, seed: int, scale: int = SCALE) -> list[TrajectoryGroup]:
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
        for i, (p, rs) in enumerate(lengths(k, n, scale, seed))
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
                old = no_grad_logprobs(learner.trainables.policy, batch, cfg, learner.precision)
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


# --- the full-scale batch on a model shape


def save_model(folder: Path, shape: str, smoke: bool, device: torch.device) -> Path:
    """A random model of `shape` (the smoke sizes with `smoke`) in bf16 and the character tokenizer in
    `folder` (kept when it holds one already: `--model-dir` reuses it across runs)."""
    if (folder / "config.json").exists():
        return folder
    kind, dims = SHAPES[shape]
    tokenizer = build_char_tokenizer()
    small = SMOKE | (MOE_SMOKE if kind is Qwen3MoeConfig else {})
    config = kind(
        **(dims | small if smoke else dims), max_position_embeddings=16384,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds for 4B parameters on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return folder


def matmul_params(model: torch.nn.Module) -> int:
    """The parameters a token's forward multiplies by: all of them but the input embedding, which is a
    lookup (no FLOPs), unless it is tied to the LM head (then it is the head's matrix, counted once).
    torchtitan and PaLM count MFU on these; counting the untied embedding too overstates it (by 13 % for
    the 1.78B's 233M-parameter embedding). A mixture-of-experts model counts its active parameters, as
    prime-rl does (`PerfCounter.get_active_mm_params`, src/prime_rl/trainer/perf.py: attention, dense MLPs,
    shared experts, top_k routed experts of 3 x hidden x moe_intermediate_size each, the router, the LM
    head): the routed experts a token is not sent to are left out (learner/plan/shape.py `count`)."""
    total = sum(p.numel() for p in model.parameters())  # tied tensors counted once
    embedding = model.get_input_embeddings().weight
    tied = embedding is getattr(model.get_output_embeddings(), "weight", None)
    counts = count(model.config.to_dict())
    inactive = counts.total - counts.active  # 0 for a dense model
    return (total if tied else total - embedding.numel()) - inactive


def budget(value: str | None) -> int | str | None:
    """A `--micro-batch-tokens` value: a number, `auto`, or None (the learner's default)."""
    return None if value is None else value if value == "auto" else int(value)


SWITCH = {"on": True, "off": False, "auto": "auto", True: True, False: False, None: None}
"""An on/off/auto flag -> the setting (`--levers`' rows set `compile_layers` True or False themselves)."""


def lever_settings(args: argparse.Namespace) -> dict:
    """The learner settings the lever flags name (unset ones keep the learner's defaults)."""
    ckpt = SWITCH[args.gradient_checkpointing]
    out = {"attn_implementation": args.attention, "logprob_head": args.logprob_head,
           "gradient_checkpointing": ckpt, "checkpoint_layers": getattr(args, "checkpoint_layers", None),
           "micro_batch_tokens": budget(args.micro_batch_tokens),
           "no_grad_micro_batch_tokens": budget(args.no_grad_micro_batch_tokens),
           "compile_layers": SWITCH[getattr(args, "compile_layers", None)],
           "prefetch": SWITCH[getattr(args, "prefetch", None)]}  # fmt: skip
    return {k: v for k, v in out.items() if v is not None}


def release_device_memory(device: torch.device) -> float | None:
    """Collect what earlier learners in this process left (a `Learner` is held by reference cycles until the
    cyclic collector runs: on a GPU, its fp32 weights and Adam state, 48 GB at 4B), give the
    cached blocks back, and return the GiB still allocated on the CUDA device (None on CPU). Before, the
    `--levers` rows ran on a device still holding an earlier row's learner: its peaks read high and the
    rows whose plans filled the device ran out of memory."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / GIB


def run_shape(args: argparse.Namespace) -> dict:
    """The long-tailed batch through the learner on `args.shape` with the levers of the flags."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.shape == "longtail-moe" and device.type != "cuda" and not args.smoke:
        layers = SHAPES["longtail-moe"][1]["num_hidden_layers"]
        raise SystemExit(
            f"longtail-moe is a GPU shape ({layers} Qwen3-30B-A3B layers: ~{11 * layers + 11} GB of weights, "
            f"gradients and AdamW state): run it on CUDA, or --smoke on {device.type}"
        )
    scale = SMOKE_SCALE if args.smoke else 1
    vocab = (SMOKE if args.smoke else SHAPES[args.shape][1])["vocab_size"]
    groups = longtail_groups(16, 8, vocab, seed=0, scale=scale)
    real = sum(len(g.prompt_ids) * len(g.trajectories) + sum(len(t.response_ids) for t in g.trajectories)
               for g in groups)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis.start(Path(tmp) / "redis") as redis:
        folder = save_model(Path(args.model_dir or Path(tmp) / "model"), args.shape, args.smoke, device)
        cfg = LearnerConfig(
            model_path=str(folder), device=str(device), precision=args.precision, redis_url=redis.url,
            run_id="longtail", groups_per_step=16, packing=args.packing != "off", micro_batch_size=ROWS_MICRO,
            rollout_correction="decoupled_token_is", torch_threads=args.threads,
            publish={"weights_dir": str(Path(tmp) / "w"), "publish_every": 10**6},
            checkpoint={"checkpoint_dir": None}, buffer={"max_times_sampled": None}, **lever_settings(args),
        )  # fmt: skip
        with ReplayBuffer(redis.url, cfg.run_id, cfg.buffer) as buf:
            buf.insert_many(groups)
        resident = release_device_memory(device)
        learner = Learner(cfg)
        try:
            start = time.perf_counter()
            learner.step()  # warm-up (and the fused head's and compiled layers' compilation)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            warmup_s = time.perf_counter() - start
            steps = [learner.step() for _ in range(args.steps)]
            peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
            profile = profile_step(learner.step, device) if getattr(args, "profile", False) else None
            params = sum(p.numel() for p in learner.model.parameters())
            flops_params = matmul_params(learner.model)
            attention = learner.model.config._attn_implementation
            settings, plan = learner.settings, learner.built.memory_plan
            precision = learner.precision.name
        finally:
            learner.close()
            del learner  # its reference cycles hold the model and optimizer until a collection
            release_device_memory(device)
    phases = {p: statistics.median(s.get(f"time/{p}", 0.0) for s in steps) for p in PHASES}
    each_s = [sum(s.get(f"time/{p}", 0.0) for p in PHASES) for s in steps]  # every measured step
    step_s = statistics.median(each_s)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return {
        "shape": args.shape + ("-smoke" if args.smoke else ""),
        "device": name,
        "precision": precision,
        "params": params,
        "rows_per_step": 16 * 8,
        "tokens_per_step": real,
        "steps": args.steps,
        "warmup_s": warmup_s,
        "step_s": step_s,
        "step_s_each": each_s,
        "step_s_min": min(each_s),
        "step_s_max": max(each_s),
        "tokens_per_s": real / step_s,
        "matmul_params": flops_params,
        "mfu": None if peak_tflops is None else 8 * flops_params * real / step_s / (peak_tflops * 1e12),
        "pi_old_s": phases["old_logprob"],
        "forward_backward_s": phases["forward_backward"],
        "optimizer_s": phases["optimizer"],
        "phases_s": phases,
        "peak_memory_gib": peak,
        "resident_gib_at_start": resident,
        "plan_gib": plan.total / GIB,
        "plan": plan.as_dict(),
        "attention": attention,
        "settings": {
            **settings.as_dict(),
            "logprob_head": cfg.logprob_head,
            "packing": cfg.packing,
        },
    } | ({"profile": profile} if profile is not None else {})
