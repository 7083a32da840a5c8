"""Run by torchrun from benchmarks/publish_gather.py (the learner part): the learner on every rank (FSDP2,
gloo or NCCL), publishing every step; rank 0 writes the median phases of the timed steps, the gradient
reductions of one more step (counted by the profiler on FSDP2's reduce ranges), then the time of the
synchronous gather (distributed/gather.py, every rank, in the step as before) plus the write of the same
weights, the median of `SYNC_REPEATS` rounds. Arguments: CONFIG STEPS OUT [MODE].

MODE `publish` (the default): all of the above. MODE `steps`: the timed steps only (the run without
publishing: its config's `publish_every` exceeds every step). Both write `step_wall_s`, the wall time of
each timed `Learner.step()` on rank 0 (with publishing on, the background gather of the previous step's
version runs during it)."""

from __future__ import annotations

import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from offpolicy.learner.config import load_config
from offpolicy.learner.distributed import current, init_from_env
from offpolicy.learner.distributed.gather import GatheredWeights
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.persist.file_generation import WeightsSnapshot, publish_snapshot
from offpolicy.learner.trainer import Learner

SYNC_REPEATS = 3
"""Timed rounds of the synchronous gather plus write (their median is `sync_publish_s`)."""
PHASES = ("sample_wait", "collate", "old_logprob", "ref_logprob", "forward_backward", "optimizer", "publish")


def main(config_path: str, steps: str, out: str, mode: str = "publish") -> None:
    assert mode in ("publish", "steps"), mode
    config = load_config(config_path, {})
    init_from_env("cpu" if config.device in (None, "cpu") else "cuda")
    learner = Learner(config)
    leader = current().is_leader
    result: dict = {}
    if leader:
        learner.step()  # warm-up
        runs, walls = [], []
        for _ in range(int(steps)):
            t0 = time.perf_counter()
            runs.append(learner.step())
            walls.append(time.perf_counter() - t0)
        result = {
            "phases_s": {p: statistics.median(r.get(f"time/{p}", 0.0) for r in runs) for p in PHASES},
            "step_s": statistics.median(sum(r.get(f"time/{p}", 0.0) for p in PHASES) for r in runs),
            "step_wall_s": walls,
        }
    if mode == "steps":
        if leader:
            learner.close()
            Path(out).write_text(json.dumps(result))
        else:
            learner.run_follower()
            learner.close()
        dist.barrier()
        leave()  # the groups destroyed, then no interpreter teardown (ranks.leave: why)
    if leader:
        before = learner.version
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            learner.step()
        minibatches = max(1, learner.version - before)  # optimizer steps of the profiled step
        reduces = collections.Counter(
            e.name for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce")
        )
        result |= {
            "grad_reductions_per_minibatch": max(reduces.values()) / minibatches if reduces else 0.0,
            "grad_sync": learner.built.grad_sync,
        }
        learner.close()  # stops the followers: the ranks are free for the synchronous gather below
    else:
        learner.run_follower()
        learner.close()
    keys, dtype = learner.built.publish_keys, learner.persist.publish_dtype
    sync = []  # the median of SYNC_REPEATS, as the step's phases are medians of the timed steps
    for _ in range(SYNC_REPEATS):
        dist.barrier()
        t0 = time.perf_counter()
        tensors = GatheredWeights(learner.model, keys, dtype, leader).wait()
        if leader:
            with tempfile.TemporaryDirectory() as tmp:
                snap = WeightsSnapshot(10_000, tensors, learner.model.config, learner.tokenizer, dtype)
                publish_snapshot(snap, Path(tmp))
            sync.append(time.perf_counter() - t0)
        del tensors
    if leader:
        result["sync_publish_s"] = statistics.median(sync)
        result["sync_publish_runs_s"] = sync
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:])
