"""A child entry, not a benchmark: run by torchrun from benchmarks/learner_fsdp.py, start the learner on
every rank (build, shard, load, first publish), write this rank's start-up host memory to
OUT.<rank>.json, stop. Arguments: CONFIG OUT."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # benchmarks/buffer.py would shadow the package

import json  # noqa: E402

from offpolicy.learner.config import load_config_from_process_env  # noqa: E402
from offpolicy.learner.distributed import current  # noqa: E402
from offpolicy.learner.launch import join  # noqa: E402
from offpolicy.learner.trainer import Learner  # noqa: E402


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
                "startup_host_bytes": learner.startup_host_bytes,
                "exact": learner.startup_host_exact,
            }
        )
    )
    if not ranks.is_leader:
        learner.follow()  # until the leader's stop
    learner.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
