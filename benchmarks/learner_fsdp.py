"""The learner on N ranks (torchrun + FSDP2) against 1 rank and the one-process learner, same global batch.

Three runs train the same Llama-shaped model (random weights) on the same groups, in the same order
(embedded Redis, FIFO, each group used once), `--steps` learner steps each, publishing every step:

    single   the one-process learner (`python -m offpolicy.learner.launch`, no torchrun, no FSDP)
    fsdp_1   torchrun --nproc-per-node 1 (FSDP2 on one rank)
    fsdp_N   torchrun --nproc-per-node N

    nodes_M  with --nnodes M > 1: M torchrun agents on this machine meeting at a c10d rendezvous on
             localhost (`--nnodes M --node-rank R`, N / M ranks each), as `offpolicy learner` starts them

Reported per run: the median step time of the steps after the first (warm-up), steps/s and trained
tokens/s; then `max_abs_weight_diff`, the largest difference of any weight between fsdp_N's and the
one-process learner's published weights after the last step (also fsdp_1's, and nodes_M's as
`max_abs_weight_diff_nnodes`), and `fsdp1_vs_single_step_ratio`.

Start-up host memory: N ranks start the learner (build, shard, load the weights, first publish) on a
larger model (`--startup-shape`, ~100M parameters on CPU) and stop; `startup_host_bytes_per_rank_ratio`
is the largest rank's peak host memory during start-up above what it held before (the kernel's VmHWM,
reset at the start) divided by the model's fp32 size, with the lean start (the default); the baseline
`..._eager` is the same with `fsdp.lean_start: false` (every rank loads the whole model, then shards).

Targets: CPU (gloo): max_abs_weight_diff(_nnodes) <= 1e-5, startup ratio <= 0.6 at 2 ranks; CUDA (NCCL):
the fsdp_1 step time within 10 % of the one-process learner's.

    python benchmarks/learner_fsdp.py [--nproc 2] [--nnodes 2] [--shape cpu-small|1.3b] [--steps 3] [--json]
                                      [--smoke]

`--smoke`: the same runs on the tiny Llama (`--shape tiny --startup-shape tiny`), 2 steps (CI).
Child processes get the checkout first on PYTHONPATH, in front of what the caller's PYTHONPATH holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from learner import synthetic_groups
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.layout import Layout
from offpolicy.learner.model import load_model, make_tiny_model
from offpolicy.learner.persist.version_folders import published_versions, version_dir

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "cpu-small": {
        "model": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 688},
        "groups": 4, "n": 4, "prompt": 32, "resp": 96, "micro": 4, "lr": 1e-4,
    },
    "1.3b": {
        "model": {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
                  "intermediate_size": 8960, "vocab_size": 151936, "dtype": "bfloat16"},
        "groups": 8, "n": 8, "prompt": 256, "resp": 768, "micro": 4, "lr": 1e-6,
    },
    "tiny": {  # --smoke: the tiny Llama's sizes
        "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
        "groups": 2, "n": 2, "prompt": 8, "resp": 16, "micro": 4, "lr": 1e-4,
    },
}  # fmt: skip
STARTUP_SHAPES = {  # ~100M parameters (~370 MB in fp32): the model dwarfs the allocator's noise
    "cpu-100m": {"hidden_size": 768, "num_layers": 6, "num_heads": 12, "intermediate_size": 2048,
                 "vocab_size": 32000},
    "1.3b": SHAPES["1.3b"]["model"],
    "tiny": SHAPES["tiny"]["model"],
}  # fmt: skip
SMOKE = {"shape": "tiny", "startup_shape": "tiny", "steps": 2}
"""`--smoke`'s defaults (flags given explicitly still win)."""
TARGET_DIFF_CPU = 1e-5
TARGET_STARTUP_RATIO = 0.6
TARGET_RATIO_CUDA = 1.10


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def launch(name: str, nproc: int | None, entry: list[str], tmp: Path, threads: int, nnodes: int = 1) -> None:
    """Run `entry` (`-m module args` or `script args`): `nproc` None = one plain process, else torchrun on
    `nproc` ranks in all, over `nnodes` agents (node ranks 0..nnodes-1, c10d on localhost) as
    `offpolicy learner` starts them (`Layout`)."""
    # the checkout first, in front of the caller's PYTHONPATH (dependencies may be installed there)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)}
    if nproc is None:
        commands = [([sys.executable, *entry], {})]
    else:
        endpoint = f"127.0.0.1:{free_port()}" if nnodes > 1 else None
        layouts = [
            Layout(nnodes, r, nproc // nnodes, endpoint, f"bench-{name}-{os.getpid()}") for r in range(nnodes)
        ]
        commands = [(lay.torchrun_argv(entry), lay.env() if nnodes > 1 else {}) for lay in layouts]
    logs = [tmp / f"{name}.{i}.log" for i in range(len(commands))]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env | extra, stdout=log.open("w"), stderr=subprocess.STDOUT)
        for (cmd, extra), log in zip(commands, logs, strict=True)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        text = "\n".join(log.read_text()[-3000:] for log in logs)
        raise SystemExit(f"{name} failed ({codes}): {text}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(name: str, nproc: int | None, cfg: LearnerConfig, tmp: Path, threads: int, nnodes: int = 1) -> dict:
    """One run: `nproc` None = the one-process learner, else torchrun on `nproc` ranks over `nnodes`."""
    cfg_file = tmp / f"{name}.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    t0 = time.perf_counter()
    launch(name, nproc, ["-m", "offpolicy.learner.launch", str(cfg_file)], tmp, threads, nnodes)
    steps = [json.loads(line) for line in Path(cfg.metrics_jsonl).read_text().splitlines()]
    timed = steps[1:] or steps
    step_s = statistics.median(sum(v for k, v in s.items() if k.startswith("time/")) for s in timed)
    tokens = statistics.median(s["tokens"] for s in timed)
    final = version_dir(cfg.weights_path, published_versions(cfg.weights_path)[-1])
    return {
        "ranks": nproc or 1,
        "nnodes": nnodes,
        "fsdp": nproc is not None,
        "step_s": step_s,
        "steps_per_s": 1.0 / step_s,
        "tokens_per_s": tokens / step_s,
        "wall_s": time.perf_counter() - t0,
        "version": int(steps[-1]["version"]),
        "_weights": weights(final),
    }


def run(args: argparse.Namespace) -> dict:
    shape = SHAPES[args.shape]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    seq = shape["prompt"] + shape["resp"]
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis.start(Path(d) / "redis") as redis:
        tmp = Path(d)
        model_dir = make_tiny_model(tmp / "model", max_position_embeddings=max(1024, seq), **shape["model"])
        initial = {k: v.detach().clone() for k, v in load_model(model_dir, "cpu").state_dict().items()}
        vocab = shape["model"].get("vocab_size", 101)
        groups = [
            g
            for i in range(args.steps)
            for g in synthetic_groups(shape["groups"], shape["n"], shape["prompt"], shape["resp"], vocab, i)
        ]
        runs = {}
        plan = [("single", None, 1), ("fsdp_1", 1, 1)] + (
            [(f"fsdp_{args.nproc}", args.nproc, 1)] if args.nproc > 1 else []
        )
        if args.nnodes > 1:
            plan.append((f"nodes_{args.nnodes}", max(args.nproc, args.nnodes), args.nnodes))
        for (
            name,
            nproc,
            nnodes,
        ) in plan:  # --nproc 1: fsdp_1 once (a second run of it would find its groups used)
            cfg = LearnerConfig(
                model_path=str(model_dir), device=device, precision=args.precision, redis_url=redis.url,
                run_id=name, groups_per_step=shape["groups"], micro_batch_size=shape["micro"],
                optimizer={"lr": shape["lr"]}, rollout_correction="decoupled_token_is", max_steps=args.steps,
                buffer={"sampler": "fifo", "max_times_sampled": 1}, sample_timeout_s=5.0,
                torch_threads=args.threads,
                publish={"weights_dir": str(tmp / name / "w"), "publish_every": 1, "keep_versions": 1},
                checkpoint={"checkpoint_dir": None}, metrics_jsonl=str(tmp / name / "metrics.jsonl"),
            )  # fmt: skip
            with ReplayBuffer(redis.url, cfg.run_id, cfg.buffer) as buf:
                buf.insert_many(groups)
            runs[name] = train(name, nproc, cfg, tmp, args.threads, nnodes)
        startup = {
            mode: startup_ratio(mode, args, device, redis.url, tmp) for mode in ("lean", "eager")
        }  # fmt: skip
    single, one = runs["single"], runs["fsdp_1"]
    many = runs.get(f"fsdp_{args.nproc}", one)
    out = {
        "shape": args.shape,
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "backend": "nccl" if device.startswith("cuda") else "gloo",
        "nproc": args.nproc,
        "steps": args.steps,
        "tokens_per_step": shape["groups"] * shape["n"] * shape["resp"],
        "max_abs_weight_diff": max_diff(many["_weights"], single["_weights"]),
        "max_abs_weight_diff_fsdp_1": max_diff(one["_weights"], single["_weights"]),
        "weights_moved": max_diff(single["_weights"], initial),
        "fsdp1_vs_single_step_ratio": one["step_s"] / single["step_s"],
        "startup_shape": args.startup_shape,
        "startup_model_fp32_bytes": startup["lean"]["model_fp32_bytes"],
        "startup_host_bytes_per_rank": startup["lean"]["per_rank"],
        "startup_host_bytes_per_rank_ratio": startup["lean"]["ratio"],
        "startup_host_bytes_per_rank_eager": startup["eager"]["per_rank"],
        "startup_host_bytes_per_rank_ratio_eager": startup["eager"]["ratio"],
        "startup_host_exact": startup["lean"]["exact"] and startup["eager"]["exact"],
        "speedup_vs_fsdp_1": one["step_s"] / many["step_s"],
        "load_avg_1m": os.getloadavg()[0],
        "runs": {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in runs.items()},
    }
    if args.nnodes > 1:
        out["nnodes"] = args.nnodes
        out["max_abs_weight_diff_nnodes"] = max_diff(
            runs[f"nodes_{args.nnodes}"]["_weights"], single["_weights"]
        )
    out["targets"] = (
        {
            "max_abs_weight_diff": TARGET_DIFF_CPU,
            "startup_host_bytes_per_rank_ratio_max": TARGET_STARTUP_RATIO,
        }
        if out["backend"] == "gloo"
        else {"fsdp1_vs_single_step_ratio_max": TARGET_RATIO_CUDA}
    )
    return out


def startup_ratio(mode: str, args: argparse.Namespace, device: str, redis_url: str, tmp: Path) -> dict:
    """Start the learner on `args.nproc` ranks on the start-up model (`lean` or `eager` start) and stop:
    each rank's peak host memory above its base during start-up, the largest over the fp32 model size."""
    folder = tmp / "startup-model"
    if not folder.exists():
        make_tiny_model(folder, **STARTUP_SHAPES[args.startup_shape])
    model = load_model(folder, "cpu")
    size = sum(p.numel() * 4 for p in model.parameters())  # unique parameters: ties counted once
    del model
    cfg = LearnerConfig(
        model_path=str(folder), device=device, precision=args.precision, redis_url=redis_url,
        run_id=f"startup-{mode}", torch_threads=args.threads, fsdp={"lean_start": mode == "lean"},
        publish={"weights_dir": str(tmp / f"startup-{mode}" / "w"), "keep_versions": 1},
        checkpoint={"checkpoint_dir": None}, metrics_jsonl=None,
    )  # fmt: skip
    cfg_file = tmp / f"startup-{mode}.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp / f"startup-{mode}"
    script = str(ROOT / "benchmarks" / "_startup_rank.py")
    launch(f"startup-{mode}", args.nproc, [script, str(cfg_file), str(out)], tmp, args.threads)
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(args.nproc)]
    per_rank = [r["startup_host_bytes"] for r in ranks]
    return {
        "model_fp32_bytes": size,
        "per_rank": per_rank,
        "ratio": max(per_rank) / size,
        "exact": all(r["exact"] for r in ranks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the sharded run (default 2)")
    ap.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="M > 1: also run M torchrun agents (c10d rendezvous on localhost), N/M ranks each",
    )
    ap.add_argument(
        "--startup-shape",
        choices=sorted(STARTUP_SHAPES),
        default=None,
        help="the model of the start-up memory runs (cpu-100m on CPU, 1.3b on CUDA; tiny: --smoke)",
    )
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="cpu-small on CPU, 1.3b on CUDA (tiny: --smoke)"
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--precision", choices=["bf16_mixed", "fp32", "bf16_pure"], default=None,
                    help="default: bf16_mixed on CUDA, fp32 on CPU")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="learner steps per run (the first is a warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--smoke", action="store_true", help="the same runs on the tiny Llama, 2 steps (CI)")
    args = ap.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    if args.shape is None:
        args.shape = (
            "1.3b"
            if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
            else "cpu-small"
        )
    if args.startup_shape is None:
        args.startup_shape = "1.3b" if args.shape == "1.3b" else "cpu-100m"
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']} on {out['device']} ({out['backend']}), {out['tokens_per_step']} tokens per step")
    for name, r in out["runs"].items():
        print(f"  {name:<8} {r['step_s'] * 1000:9.1f} ms/step  {r['steps_per_s']:6.2f} steps/s  "
              f"{r['tokens_per_s']:9.0f} tokens/s")  # fmt: skip
    print(
        f"  max |w_{out['nproc']} - w_single| {out['max_abs_weight_diff']:.2e} (fsdp_1: "
        f"{out['max_abs_weight_diff_fsdp_1']:.2e}; weights moved {out['weights_moved']:.2e})"
    )
    if "max_abs_weight_diff_nnodes" in out:
        print(f"  max |w_{out['nnodes']} nodes - w_single| {out['max_abs_weight_diff_nnodes']:.2e}")
    print(
        f"  start-up host memory per rank / fp32 model ({out['startup_model_fp32_bytes'] / 2**20:.0f} MiB): "
        f"lean {out['startup_host_bytes_per_rank_ratio']:.2f}, "
        f"eager {out['startup_host_bytes_per_rank_ratio_eager']:.2f}"
    )
    print(
        f"  fsdp_1 / single step time {out['fsdp1_vs_single_step_ratio']:.3f}; "
        f"{out['nproc']} ranks vs 1: {out['speedup_vs_fsdp_1']:.2f}x; load {out['load_avg_1m']:.1f}"
    )


if __name__ == "__main__":
    main()
