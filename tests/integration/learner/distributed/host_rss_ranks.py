"""Run by torchrun from tests/gpu/test_cluster_cuda.py: the learner on this rank trains `STEPS` steps,
publishing and checkpointing (DCP's pinned stager) every step, then rank 0 writes its peak resident set
(`ru_maxrss`) and the host memory plan the learner computed for it at start (learner/plan/host.py).
Arguments: CONFIG STEPS OUT."""

from __future__ import annotations

import json
import resource
import sys

from tests.integration.learner.distributed.torchrun import leader_learner


def main(config_path: str, steps: str, out: str) -> None:
    with leader_learner(config_path) as learner:
        if learner is None:
            return
        for _ in range(int(steps)):
            learner.step()
        learner.persist.flush()  # the last publish and checkpoint written: every part has existed
        result = {
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
            "plan_gib": learner.built.host_plan,
        }
        with open(out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
