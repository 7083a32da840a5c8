"""Run by torchrun from test_grad_sync.py (2 ranks, FSDP2, gloo) and tests/gpu/test_cluster_cuda.py (one GPU,
FSDP2, NCCL: the config's `device`): one learner step under the profiler; rank 0 writes, per FSDP unit,
how many times its gradients were reduce-scattered (FSDP2's `FSDP::post_backward_reduce` ranges), with the
optimizer and micro-batch counts. Arguments: CONFIG OUT."""

from __future__ import annotations

import collections
import json
import sys

from torch.profiler import ProfilerActivity, profile

from tests.integration.learner.distributed.torchrun import leader_learner


def main(config_path: str, out: str) -> None:
    with leader_learner(config_path) as learner:
        if learner is None:
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            learner.step()
        reduces = collections.Counter(
            e.name for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce")
        )
        result = {
            "reductions_per_unit": sorted(set(reduces.values())),
            "units": len(reduces),
            "optimizer_steps": learner.version,  # a fresh run: the version counts optimizer steps
            "grad_sync": learner.built.grad_sync,
        }
        with open(out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
