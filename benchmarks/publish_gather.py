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

    python benchmarks/publish_gather.py [--nproc 2] [--shape cpu-small|1.3b] [--repeats 5] [--json] [--smoke]

The learner part (`benchmarks/_publish_ranks.py`): the learner itself on `--nproc` ranks (gloo on CPU,
NCCL on CUDA), publishing every step on a publish-heavy shape (`publish-heavy`: a large vocabulary, little
compute; `--learner-shape`). `publish_share`: the step's `publish` phase over the step (the gather runs on a
helper thread over a process group of its own; the step waits only for its shards' host snapshot; target
<= 0.05); `sync_publish_share`: the synchronous gather (`GatheredWeights`, in the step, as before) plus the
write of the same weights, over the step without publish plus it (>= 0.3 shows the shape is publish-heavy);
`grad_reductions_per_minibatch`: FSDP2 reduce-scatters per unit per optimizer step, counted by the
profiler (1 under `fsdp.grad_sync: auto` when the plan fits).
`step_s_no_publish` / `step_s_publish`: the median wall time of rank 0's `Learner.step()` over the
`--learner-steps` timed steps (`publish_step_slowdown_steps`; after one warm-up step) of the same learner,
shape and data run twice, first with no publish at all, then publishing every step (each step runs while
the previous version's background gather and write run on their threads); `publish_step_slowdown` is
their ratio: what the background gather costs the rest of the step (`publish_share` counts only the
`publish` phase).

`--smoke`: the same gathers on the tiny Llama (`--shape tiny`), one timed round (CI). The ranks get the
checkout first on PYTHONPATH, in front of what the caller's PYTHONPATH holds.
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
import uuid
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "cpu-small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376,
                  "vocab_size": 32000},
    "1.3b": {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936},
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},  # --smoke
    "publish-heavy": {"hidden_size": 1024, "num_layers": 2, "num_heads": 16, "intermediate_size": 2816,
                      "vocab_size": 65536},
}  # fmt: skip
SMOKE = {"shape": "tiny", "repeats": 1, "learner_shape": "tiny", "learner_steps": 2}
"""`--smoke`'s defaults (flags given explicitly still win)."""
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
    from offpolicy.learner.distributed.ranks import leave
    from offpolicy.learner.model import load_model
    from offpolicy.learner.model.load import unique_state
    from offpolicy.learner.model.policy import LogProbs
    from offpolicy.learner.model.precision import Precision
    from offpolicy.learner.persist.file_generation import HostCopy

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
    dist.barrier()
    leave()  # the groups destroyed, then no interpreter teardown (ranks.leave: why)


def run(args: argparse.Namespace) -> dict:
    from offpolicy.learner.model import make_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = make_tiny_model(tmp / "model", dtype="bfloat16", **SHAPES[args.shape])
        out = tmp / "result.json"
        # the checkout first, in front of the caller's PYTHONPATH (dependencies may be installed there)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(args.threads)}
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


def learner_run(args: argparse.Namespace) -> dict:
    """The learner on `args.nproc` ranks publishing every step: publish share, sync share, reductions;
    and the same learner, shape and data without publishing: the step's wall time both ways."""
    import yaml

    from offpolicy.buffer.embedded import EmbeddedRedis
    from offpolicy.buffer.replay_buffer import ReplayBuffer
    from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.model import make_tiny_model

    shape = SHAPES[args.learner_shape]
    # groups per step (one optimizer step), completions, prompt and response tokens: little compute (and
    # few FSDP all-gathers: one micro-batch per pass) for the weights' size; bypass mode (the behaviour
    # log-probs are pi_old): no pi_old forward, whose FSDP2 all-gathers are, on gloo, most of a step
    groups, n, prompt, resp = 2, 2, 8, 8
    vocab = shape.get("vocab_size", 101)
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis.start(Path(d) / "redis") as redis:
        tmp = Path(d)
        model_dir = make_tiny_model(tmp / "model", **shape)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(args.threads)}
        script = str(Path(__file__).resolve().parent / "_publish_ranks.py")
        res = {}
        # the same learner without publishing first (`publish_every` past every step), then publishing
        for mode, every in (("steps", 10**9), ("publish", 1)):
            cfg = LearnerConfig(
                model_path=str(model_dir), redis_url=redis.url, run_id=f"publish-bench-{mode}",
                groups_per_step=groups, micro_batch_size=n * groups, packing=False,
                torch_threads=args.threads, rollout_correction="bypass_ppo_clip",
                checkpoint={"checkpoint_dir": None},
                publish={"weights_dir": str(tmp / mode / "w"), "publish_every": every, "keep_versions": 2},
                buffer={"sampler": "fifo", "max_times_sampled": 1},
            )  # fmt: skip
            rng = np.random.default_rng(0)
            with ReplayBuffer(redis.url, cfg.run_id, cfg.buffer) as buf:
                buf.insert_many([
                    TrajectoryGroup(
                        group_id=uuid.uuid4().hex, prompt_id=f"p{i}",
                        prompt_ids=rng.integers(4, vocab, prompt, dtype=np.int32), policy_version=0,
                        actor_id="bench", created_at=time.time(),
                        sampling=SamplingParams(temperature=1.0, max_tokens=resp),
                        trajectories=[
                            Trajectory(
                                response_ids=rng.integers(4, vocab, resp, dtype=np.int32),
                                behavior_logprobs=-(rng.random(resp, dtype=np.float32) * 4 + 2),
                                reward=float(rng.random()), finish_reason="length",
                            )
                            for _ in range(n)
                        ],
                    )
                    for i in range(groups * (args.learner_steps + 2))
                ])  # fmt: skip
            (tmp / f"{mode}.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
            out = tmp / f"{mode}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.nproc}", script, str(tmp / f"{mode}.yaml"),
                   str(args.learner_steps), str(out), mode]  # fmt: skip
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(
                    f"torchrun failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}"
                )
            res[mode] = json.loads(out.read_text())
    off, res = res["steps"], res["publish"]
    step_off, step_on = statistics.median(off["step_wall_s"]), statistics.median(res["step_wall_s"])
    step, publish, sync_s = res["step_s"], res["phases_s"]["publish"], res["sync_publish_s"]
    return {
        "learner_shape": args.learner_shape,
        "learner_step_s": step,
        "learner_phases_s": res["phases_s"],
        "publish_share": publish / step,
        "sync_publish_s": sync_s,
        "sync_publish_runs_s": res["sync_publish_runs_s"],
        "sync_publish_share": sync_s / (step - publish + sync_s),
        "grad_reductions_per_minibatch": res["grad_reductions_per_minibatch"],
        "grad_sync": res["grad_sync"],
        "step_s_no_publish": step_off,
        "step_s_publish": step_on,
        "publish_step_slowdown": step_on / step_off,
        "publish_step_slowdown_steps": len(res["step_wall_s"]),
        "step_wall_s_no_publish_runs": off["step_wall_s"],
        "step_wall_s_publish_runs": res["step_wall_s"],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="cpu-small on CPU, 1.3b on CUDA (tiny: --smoke)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds after a warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    ap.add_argument("--learner-shape", choices=sorted(SHAPES), default="publish-heavy",
                    help="the learner part's model (default publish-heavy)")  # fmt: skip
    ap.add_argument("--learner-steps", type=int, default=4, help="the learner part's timed steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--smoke", action="store_true", help="the tiny Llama, one timed round (CI)")
    args = ap.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    args.shape = args.shape or ("1.3b" if torch.cuda.is_available() else "cpu-small")
    out = run(args) | learner_run(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']} ({out['params'] / 1e6:.0f}M parameters) on {out['device']}, {out['nproc']} ranks "
          f"({out['backend']}), publish dtype {out['publish_dtype']}")  # fmt: skip
    print(f"  state_dict (fp32 gather, then cast)  {out['state_dict_s'] * 1000:8.1f} ms")
    print(f"  cast_first (GatheredWeights)         {out['cast_first_s'] * 1000:8.1f} ms")
    print(f"  speedup {out['speedup']:.2f}x (target >= {TARGET_SPEEDUP}); "
          f"same tensors: {out['same_tensors']}; load {out['load_avg_1m']:.1f}")  # fmt: skip
    print(f"  learner ({out['learner_shape']}, {out['nproc']} ranks): step {out['learner_step_s']:.3f} s, "
          f"publish share {out['publish_share']:.3f} (target <= 0.05), synchronous gather + write share "
          f"{out['sync_publish_share']:.3f}, gradient reductions per optimizer step "
          f"{out['grad_reductions_per_minibatch']:g} ({out['grad_sync']})")  # fmt: skip
    print(f"  step wall time without publishing {out['step_s_no_publish']:.3f} s, publishing every step "
          f"{out['step_s_publish']:.3f} s: slowdown {out['publish_step_slowdown']:.3f}x (medians of "
          f"{out['publish_step_slowdown_steps']} steps)")  # fmt: skip


if __name__ == "__main__":
    main()
