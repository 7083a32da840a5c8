"""Container entry point: give each actor replica its own seeds from its replica name, then exec `offpolicy`.

Every actor reads the whole dataset as one shard (`num_actors: 1`, `actor_index: 0`, set by compose and
k8s) in its own per-epoch order: `dataset.seed` and `engine.seed` are the replica's index, so any number
of replicas (`docker compose up --scale actor=N`, an HPA) covers every prompt without repeating each
other's order or samples (docs/deploy.md "Scaling actors"). Compose cannot hand each replica a
different environment, but Docker's DNS answers a reverse lookup of a container's own address with its
name (`offpolicy-actor-3.offpolicy_backend`): replica k gets index k-1. On Kubernetes the StatefulSet sets
the seeds from the pod ordinal and this does nothing; a hostname `actor-2` (a StatefulSet pod without
them) gives index 2.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Callable, MutableMapping

_COMPOSE_NAME = re.compile(r"^[\w.-]+-actor-(\d+)(?:\.|$)")  # offpolicy-actor-3[.network]
_STATEFULSET_NAME = re.compile(r"^actor-(\d+)$")  # actor-2


def replica_index(own_name: str) -> int | None:
    """The 0-based actor index a compose or StatefulSet replica name implies; None if it implies none."""
    if match := _COMPOSE_NAME.match(own_name):
        return int(match[1]) - 1
    if match := _STATEFULSET_NAME.match(own_name):
        return int(match[1])
    return None


def own_names() -> list[str]:
    """This container's names: the reverse DNS name of its address, then its hostname."""
    hostname = socket.gethostname()
    names = []
    try:
        address = socket.gethostbyname(hostname)
        names.append(socket.gethostbyaddr(address)[0])
    except OSError as exc:  # no DNS answer: fall back to the hostname alone
        print(f"entrypoint: reverse lookup of {hostname} failed ({exc})", file=sys.stderr)
    names.append(hostname)
    return names


def set_replica_seeds(env: MutableMapping[str, str], names: Callable[[], list[str]] = own_names) -> None:
    """Set OFFPOLICY_DATASET__SEED, OFFPOLICY_ENGINE__SEED (and OFFPOLICY_ACTOR_ID when unset) to the
    replica's index unless the dataset seed is given; raise SystemExit if no name tells the index."""
    if env.get("OFFPOLICY_DATASET__SEED"):
        return
    tried = names()
    index = next((i for i in map(replica_index, tried) if i is not None), None)
    if index is None:
        raise SystemExit(
            f"entrypoint: OFFPOLICY_DATASET__SEED is unset and no replica name in {tried} gives an index"
        )
    env["OFFPOLICY_DATASET__SEED"] = str(index)
    env["OFFPOLICY_ENGINE__SEED"] = str(index)
    env.setdefault("OFFPOLICY_ACTOR_ID", f"actor-{index}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["actor"]:
        set_replica_seeds(os.environ)
        print(f"entrypoint: actor seeds {os.environ['OFFPOLICY_DATASET__SEED']}", file=sys.stderr)
    os.execvp("offpolicy", ["offpolicy", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
