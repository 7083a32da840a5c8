"""A learner on N ranks without the service around it, and the entry every follower rank runs.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m offpolicy.learner.launch learner.yaml

runs the loop on every rank until `max_steps` (rank 0 samples from Redis, publishes and checkpoints as
the service does) and exits; without torchrun it is the one-process learner. `offpolicy learner
--nproc-per-node N` runs the service instead: rank 0 the REST API around the same loop
(services/learner_api/__main__.py), the other ranks `follow`.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from offpolicy.learner.config import LearnerConfig, load_config_from_process_env
from offpolicy.learner.distributed import current, init_from_env
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.model.precision import pick_device

log = logging.getLogger(__name__)


def join(config: LearnerConfig) -> None:
    """Join torchrun's process group (when there is one) on the config's device type."""
    init_from_env(pick_device(config.device).type)


def run_follower(config: LearnerConfig) -> int:
    """A follower rank: build its share of the learner, run the leader's commands until `stop`.

    SIGTERM is left to the leader: torchrun signals every rank at once, and a follower that died at once
    would fail the leader's last step, publish or checkpoint; the leader stops at its step boundary and
    sends `stop` (a leader that is gone fails the follower's next collective, which ends it)."""
    from offpolicy.learner.trainer import Learner

    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: stopping when the leader says so"))
    learner = Learner(config)
    try:
        learner.run_follower()
    finally:
        learner.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m offpolicy.learner.launch CONFIG.(yaml|json)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config_from_process_env(argv[0])
    join(config)
    from offpolicy.learner.trainer import Learner

    if not current().is_leader:
        return run_follower(config)
    learner = Learner(config)
    try:
        learner.run(threading.Event())
    finally:
        learner.close()
    log.info("finished at version %d after %d steps", learner.version, learner.step_count)
    return 0


if __name__ == "__main__":
    code = main()
    if current().distributed:  # a rank under torchrun: no interpreter teardown (ranks.leave: why)
        leave(code)
    sys.exit(code)
