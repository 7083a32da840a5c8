"""Publishing on N ranks: the full weights to rank 0's host memory, two ways, on the same sharded model.

    state_dict   torch.distributed.checkpoint's `get_model_state_dict(full_state_dict=True,
                 cpu_offload=True)` (the fp32 masters gathered, copied to pageable host memory), then cast
                 into the publish buffers (`HostCopy`, as the one-process learner does): the baseline
    cast_first   `offpolicy.learner.distributed.GatheredWeights`: each shard cast to the publish dtype on its
    rank,
                 gathered one tensor at a time, copied into reused (pinned on CUDA) host buffers

Both are timed from the call until rank 0 holds the publish-dtype tensors (the learner's step boundary
waits for the gather; the host copy then overlaps the next step on CUDA), median of `--repeats` after a
warm-up. Reported: `state_dict_s`, `cast_first_s`, `speedup` (state_dict_s / cast_first_s), the bytes
each all-gathers, and whether both give the same tensors. Target: speedup >= 1.5 with a bf16 publish.

    python benchmarks/publish_gather.py [--nproc 2] [--shape cpu-small|1.3b] [--repeats 5] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python benchmarks/publish_gather.py` puts benchmarks/ first on sys.path, where buffer.py would shadow the
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

SHAPES = {
    "cpu-small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376,
                  "vocab_size": 32000},
    "1.3b": {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936},
}  # fmt: skip
TARGET_SPEEDUP = 1.5


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rank_main(model_dir: str, repeats: int, out: str) -> None:
    """Under torchrun: shard, then time both gathers (every rank joins each; rank 0 writes the JSON)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from offpolicy.learner.distributed import init_from_env, local_device
    from offpolicy.learner.distributed.fsdp import shard
    from offpolicy.learner.distributed.gather import GatheredWeights
    from offpolicy.learner.model import load_model
    from offpolicy.learner.model.load import unique_state
    from offpolicy.learner.model.policy import LogProbs
    from offpolicy.learner.model.precision import Precision
    from offpolicy.learner.persist.published import HostCopy

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = init_from_env(device_type)
    device = local_device(ranks, torch.device(device_type))
    model = load_model(model_dir, "cpu", torch.float32)
    keys = set(unique_state(model))
    precision = Precision.resolve("bf16_mixed" if device_type == "cuda" else "fp32", device)
    shard(LogProbs(model), model.config.num_hidden_layers, precision, False)  # moves the shards to `device`
    leader, dtype = ranks.is_leader, torch.bfloat16
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    buffers: dict[str, dict[str, torch.Tensor] | None] = {"state_dict": None, "cast_first": None}

    def state_dict() -> dict[str, torch.Tensor]:
        full = {k: v for k, v in get_model_state_dict(model, options=opts).items() if k in keys}
        if not leader:
            return {}
        copy = HostCopy(full, dtype, into=buffers["state_dict"])
        buffers["state_dict"] = copy.tensors
        return copy.wait()

    def cast_first() -> dict[str, torch.Tensor]:
        got = GatheredWeights(model, keys, dtype, leader, into=buffers["cast_first"]).wait()
        buffers["cast_first"] = got if leader else None
        return got

    times: dict[str, list[float]] = {"state_dict": [], "cast_first": []}
    results = {}
    for i in range(repeats + 1):
        for name, fn in (("state_dict", state_dict), ("cast_first", cast_first)):
            dist.barrier()
            _sync()
            t0 = time.perf_counter()
            results[name] = fn()
            _sync()
            if i > 0:  # the first round is a warm-up (buffers allocated, pinned)
                times[name].append(time.perf_counter() - t0)
    if leader:
        a, b = results["state_dict"], results["cast_first"]
        params = sum(t.numel() for t in b.values())
        same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        with open(out, "w") as fh:
            json.dump({"params": params, "times": times, "same_tensors": same}, fh)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    from offpolicy.learner.model import make_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = make_tiny_model(tmp / "model", dtype="bfloat16", **SHAPES[args.shape])
        out = tmp / "result.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
        ]
        me = str(Path(__file__).resolve())
        cmd = [*torchrun, me, "--rank-main", str(model_dir), str(args.repeats), str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"torchrun failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        res = json.loads(out.read_text())
    state_s = statistics.median(res["times"]["state_dict"])
    cast_s = statistics.median(res["times"]["cast_first"])
    params = res["params"]
    return {
        "shape": args.shape,
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "backend": "nccl" if device == "cuda" else "gloo",
        "nproc": args.nproc,
        "params": params,
        "publish_dtype": "bfloat16",
        "state_dict_s": state_s,
        "cast_first_s": cast_s,
        "speedup": state_s / cast_s,
        "state_dict_gathered_bytes": 4 * params,
        "cast_first_gathered_bytes": 2 * params,
        "same_tensors": res["same_tensors"],
        "target_speedup": TARGET_SPEEDUP,
        "load_avg_1m": os.getloadavg()[0],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="cpu-small on CPU, 1.3b on CUDA")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds after a warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    args.shape = args.shape or ("1.3b" if torch.cuda.is_available() else "cpu-small")
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']} ({out['params'] / 1e6:.0f}M parameters) on {out['device']}, {out['nproc']} ranks "
          f"({out['backend']}), publish dtype {out['publish_dtype']}")  # fmt: skip
    print(f"  state_dict (fp32 gather, then cast)  {out['state_dict_s'] * 1000:8.1f} ms")
    print(f"  cast_first (GatheredWeights)         {out['cast_first_s'] * 1000:8.1f} ms")
    print(f"  speedup {out['speedup']:.2f}x (target >= {TARGET_SPEEDUP}); "
          f"same tensors: {out['same_tensors']}; load {out['load_avg_1m']:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
