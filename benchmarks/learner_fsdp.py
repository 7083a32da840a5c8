"""The learner on N ranks (torchrun + FSDP2) against 1 rank and the one-process learner, same global batch.

Three runs train the same Llama-shaped model (random weights) on the same groups, in the same order
(embedded Redis, FIFO, each group used once), `--steps` learner steps each, publishing every step:

    single   the one-process learner (`python -m learner.launch`, no torchrun, no FSDP)
    fsdp_1   torchrun --nproc-per-node 1 (FSDP2 on one rank)
    fsdp_N   torchrun --nproc-per-node N

Reported per run: the median step time of the steps after the first (warm-up), steps/s and trained
tokens/s; then `max_abs_weight_diff`, the largest difference of any weight between fsdp_N's and the
one-process learner's published weights after the last step (also fsdp_1's), and
`fsdp1_vs_single_step_ratio`. Targets: CPU (gloo): max_abs_weight_diff <= 1e-5; CUDA (NCCL): the fsdp_1
step time within 10 % of the one-process learner's.

    python benchmarks/learner_fsdp.py [--nproc 2] [--shape cpu-small|1.3b] [--steps 3] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python benchmarks/learner_fsdp.py` puts benchmarks/ first on sys.path, where buffer.py would shadow the
# package: put the repository root there instead.
ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from benchmarks.learner import synthetic_groups  # noqa: E402
from buffer.embedded import EmbeddedRedis  # noqa: E402
from buffer.replay_buffer import ReplayBuffer  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.model import load_model, make_tiny_model  # noqa: E402
from learner.persist.weights import published_versions, version_dir  # noqa: E402

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
}  # fmt: skip
TARGET_DIFF_CPU = 1e-5
TARGET_RATIO_CUDA = 1.10


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def train(name: str, nproc: int | None, cfg: LearnerConfig, tmp: Path, threads: int) -> dict:
    """One run: `nproc` None = the one-process learner, else torchrun on `nproc` ranks."""
    cfg_file = tmp / f"{name}.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    launch = [sys.executable, "-m", "learner.launch", str(cfg_file)]
    if nproc is not None:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                  "-m", "learner.launch", str(cfg_file)]  # fmt: skip
    t0 = time.perf_counter()
    with (tmp / f"{name}.log").open("w") as log:
        rc = subprocess.run(launch, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if rc.returncode != 0:
        raise SystemExit(f"{name} failed ({rc.returncode}): {(tmp / f'{name}.log').read_text()[-3000:]}")
    steps = [json.loads(line) for line in Path(cfg.metrics_jsonl).read_text().splitlines()]
    timed = steps[1:] or steps
    step_s = statistics.median(sum(v for k, v in s.items() if k.startswith("time/")) for s in timed)
    tokens = statistics.median(s["tokens"] for s in timed)
    final = version_dir(cfg.weights_path, published_versions(cfg.weights_path)[-1])
    return {
        "ranks": nproc or 1,
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
        plan = [("single", None), ("fsdp_1", 1)] + (
            [(f"fsdp_{args.nproc}", args.nproc)] if args.nproc > 1 else []
        )
        for name, nproc in plan:  # --nproc 1: fsdp_1 once (a second run of it would find its groups used)
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
            runs[name] = train(name, nproc, cfg, tmp, args.threads)
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
        "speedup_vs_fsdp_1": one["step_s"] / many["step_s"],
        "load_avg_1m": os.getloadavg()[0],
        "runs": {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in runs.items()},
    }
    out["targets"] = (
        {"max_abs_weight_diff": TARGET_DIFF_CPU}
        if out["backend"] == "gloo"
        else {"fsdp1_vs_single_step_ratio_max": TARGET_RATIO_CUDA}
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the sharded run (default 2)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="cpu-small on CPU, 1.3b on CUDA")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--precision", choices=["bf16_mixed", "fp32", "bf16_pure"], default=None,
                    help="default: bf16_mixed on CUDA, fp32 on CPU")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="learner steps per run (the first is a warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.shape is None:
        args.shape = (
            "1.3b"
            if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
            else "cpu-small"
        )
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
    print(
        f"  fsdp_1 / single step time {out['fsdp1_vs_single_step_ratio']:.3f}; "
        f"{out['nproc']} ranks vs 1: {out['speedup_vs_fsdp_1']:.2f}x; load {out['load_avg_1m']:.1f}"
    )


if __name__ == "__main__":
    main()
