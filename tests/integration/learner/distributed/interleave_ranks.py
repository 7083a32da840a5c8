"""Run by torchrun from test_publish_interleave.py (2 ranks, FSDP2, gloo): the learner on this rank trains
STEPS steps, publishing every step as files (each publish's gather to rank 0 runs in the background while
the next steps train); rank 0 writes each step's phase times, and the newest published version once every
rank closed its learner, how many shard snapshot sets it allocated
and the most it kept at once. Arguments: CONFIG STEPS OUT."""

from __future__ import annotations

import json
import sys
import time

from offpolicy.weights import host_buffers
from tests.integration.learner.distributed.torchrun import leader_learner


def main(config_path: str, steps: str, out: str) -> None:
    rows, live, leader = [], 0, None
    with leader_learner(config_path) as learner:
        if learner is None:
            return
        leader = learner
        for _ in range(int(steps)):
            t0 = time.perf_counter()
            metrics = learner.step()
            phases = {k.removeprefix("time/"): v for k, v in metrics.items() if k.startswith("time/")}
            rows.append({"wall_s": time.perf_counter() - t0, "phases": phases})
            live = max(live, len(learner.persist.host_sets()))
    # closed on every rank (a gather still waiting starts on both: a flush on the leader alone would hang)
    result = {
        "steps": rows,
        "version": leader.version,
        "published": leader.persist.published_version,
        "host_sets_made": host_buffers.made,
        "host_sets_kept": live,
    }
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
