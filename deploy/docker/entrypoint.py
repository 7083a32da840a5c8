"""Container entry point: each actor gets its seeds from its explicit replica index; then exec `offpolicy`.

Every actor reads the whole dataset as one shard (`num_actors: 1`, `actor_index: 0`, set by compose and
k8s) in its own per-epoch order: `dataset.seed` and `engine.seed` are the actor's replica index, and
`actor-<index>` its `actor_id`, so any number of actors covers every prompt without repeating each other's
order or samples (docs/deploy.md "Scaling actors"). The index is set explicitly, never guessed:

- compose: each actor service sets `OFFPOLICY_REPLICA_INDEX` (docker-compose.8gpu.yml: 0..3);
- Kubernetes: the StatefulSet sets it from the pod's ordinal (the `apps.kubernetes.io/pod-index` label
  through the downward API).

Seeds or an actor id given explicitly (`OFFPOLICY_DATASET__SEED`, ...) win over the derived ones.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

REPLICA_INDEX = "OFFPOLICY_REPLICA_INDEX"


def set_replica_seeds(env: MutableMapping[str, str]) -> None:
    """Set OFFPOLICY_DATASET__SEED, OFFPOLICY_ENGINE__SEED and OFFPOLICY_ACTOR_ID from
    OFFPOLICY_REPLICA_INDEX where they are unset; raise SystemExit when the index is missing or invalid
    and no dataset seed is given."""
    raw = env.get(REPLICA_INDEX, "")
    if raw == "":
        if env.get("OFFPOLICY_DATASET__SEED"):
            return
        raise SystemExit(
            f"entrypoint: set {REPLICA_INDEX} (this actor's index: 0, 1, ...; a StatefulSet sets it from "
            "the pod ordinal) or OFFPOLICY_DATASET__SEED"
        )
    if not raw.isdigit():
        raise SystemExit(f"entrypoint: {REPLICA_INDEX}={raw!r} is not a non-negative integer")
    index = int(raw)
    for name, value in (
        ("OFFPOLICY_DATASET__SEED", str(index)),
        ("OFFPOLICY_ENGINE__SEED", str(index)),
        ("OFFPOLICY_ACTOR_ID", f"actor-{index}"),
    ):
        if not env.get(name):
            env[name] = value


def main(argv: list[str]) -> None:
    if argv[:1] == ["actor"]:
        set_replica_seeds(os.environ)
        print(f"entrypoint: actor seeds {os.environ['OFFPOLICY_DATASET__SEED']}", file=sys.stderr)
    os.execvp("offpolicy", ["offpolicy", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
