"""A child entry, not a benchmark: run by torchrun from benchmarks/learner_fsdp.py, start the learner on
every rank (build, shard, load, first publish), write this rank's start-up host memory to
OUT.<rank>.json, stop. Arguments: CONFIG OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from offpolicy.learner.config import load_config_from_process_env
from offpolicy.learner.distributed import current
from offpolicy.learner.launch import join
from offpolicy.learner.trainer import Learner


def main(cfg: str, out: str) -> None:
    config = load_config_from_process_env(cfg)
    join(config)
    learner = Learner(config)
    ranks = current()
    Path(f"{out}.{ranks.rank}.json").write_text(
        json.dumps(
            {
                "rank": ranks.rank,
                "world_size": ranks.world_size,
                "startup_host_bytes": learner.built.startup_host_bytes,
                "exact": learner.built.startup_host_exact,
            }
        )
    )
    if not ranks.is_leader:
        learner.run_follower()  # until the leader's stop
    learner.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
