"""Run by torchrun from test_publish_interleave.py (2 ranks, FSDP2, gloo): the learner on this rank trains
STEPS steps, publishing every step as files (each publish's gather to rank 0 runs in the background while
the next steps train); rank 0 writes each step's phase times, and the newest published version once the
writes are flushed. Arguments: CONFIG STEPS OUT."""

from __future__ import annotations

import json
import sys
import time

from tests.integration.learner.distributed.torchrun import leader_learner


def main(config_path: str, steps: str, out: str) -> None:
    with leader_learner(config_path) as learner:
        if learner is None:
            return
        rows = []
        for _ in range(int(steps)):
            t0 = time.perf_counter()
            metrics = learner.step()
            phases = {k.removeprefix("time/"): v for k, v in metrics.items() if k.startswith("time/")}
            rows.append({"wall_s": time.perf_counter() - t0, "phases": phases})
        learner.persist.flush()
        record = learner.persist.store.read()
        result = {
            "steps": rows,
            "version": learner.version,
            "published": None if record is None else record.version,
        }
        with open(out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
