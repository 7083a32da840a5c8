"""The gloo engine's group init (weights/engines/gloo.py `init_group`) leaves the process's standard output
where it was, even when two inits run at once in one process (vLLM's helper points fd 1 at /dev/null while
it forms a group and puts back what it saved: two at once each saved the other's /dev/null, and every
later print of the process was lost; the weight_delta benchmark's JSON went missing 2 runs in 3)."""

from __future__ import annotations

import os
import socket
import threading

import pytest


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_two_concurrent_group_inits_leave_stdout_where_it_was():
    pytest.importorskip("vllm")
    from offpolicy.weights.engines.gloo import init_group

    before = os.readlink("/proc/self/fd/1")
    for _ in range(6):
        port, groups = _port(), {}

        def join(p: int = port, into: dict = groups) -> None:
            into["w"] = init_group("127.0.0.1", p, 1, 2, 30.0)

        side = threading.Thread(target=join)
        side.start()
        groups["t"] = init_group("127.0.0.1", port, 0, 2, 30.0)
        side.join(60)
        for g in groups.values():
            g.shutdown()
        assert os.readlink("/proc/self/fd/1") == before
