"""`publish.transfer.address`, checked when the learner starts (learner/transport/vllm.py, m2n.py)."""

from __future__ import annotations

import socket


def check_bindable(address: str) -> None:
    """Refuse `publish.transfer.address` unless this host can bind it: vLLM's rank 0 (the learner) binds its
    rendezvous store's listening socket to that address (IPv4), so a name that resolves elsewhere (a
    ClusterIP Service's) fails every send later, only logged. ValueError naming the field and the fix."""
    field = "publish.transfer.address"
    try:
        ips = sorted({info[4][0] for info in socket.getaddrinfo(address, None, socket.AF_INET)})
    except socket.gaierror as e:
        raise ValueError(f"{field} {address!r} does not resolve on the learner's host ({e})") from e
    for ip in ips:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((ip, 0))
                return
            except OSError:
                continue
    raise ValueError(
        f"{field} {address!r} ({', '.join(ips)}) is not an address of the learner's host: rank 0 binds its "
        "rendezvous store there. Give the learner pod's own IP (status.podIP through the downward API) or a "
        "headless Service's name, not a ClusterIP Service's (docs/deploy.md)"
    )
