"""Container entry point: derive an actor's index from its replica name, then exec `offpolicy` (one process).

`docker compose up --scale actor=N` starts replicas named `<project>-actor-1 … -N` but cannot hand each one
a different environment. Docker's DNS answers a reverse lookup of a container's own address with that
name (`offpolicy-actor-3.offpolicy_backend`), so replica k gets `OFFPOLICY_ACTOR_INDEX=k-1`. On
Kubernetes the StatefulSet sets `OFFPOLICY_ACTOR_INDEX` from the pod ordinal and this does nothing;
a hostname such as `actor-2` (a StatefulSet pod without the variable) gives index 2.
`OFFPOLICY_NUM_ACTORS` is raised to index + 1 when it is smaller, so a scaled-up replica starts.
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


def set_actor_index(env: MutableMapping[str, str], names: Callable[[], list[str]] = own_names) -> None:
    """Fill OFFPOLICY_ACTOR_INDEX (and raise OFFPOLICY_NUM_ACTORS) when unset; raise if no name tells."""
    if env.get("OFFPOLICY_ACTOR_INDEX"):
        return
    tried = names()
    index = next((i for i in map(replica_index, tried) if i is not None), None)
    if index is None:
        raise SystemExit(
            f"entrypoint: OFFPOLICY_ACTOR_INDEX is unset and no replica name in {tried} gives one"
        )
    env["OFFPOLICY_ACTOR_INDEX"] = str(index)
    env["OFFPOLICY_NUM_ACTORS"] = str(max(int(env.get("OFFPOLICY_NUM_ACTORS") or 1), index + 1))
    env.setdefault("OFFPOLICY_ACTOR_ID", f"actor-{index}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["actor"]:
        set_actor_index(os.environ)
        print(f"entrypoint: actor index {os.environ['OFFPOLICY_ACTOR_INDEX']}", file=sys.stderr)
    os.execvp("offpolicy", ["offpolicy", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
