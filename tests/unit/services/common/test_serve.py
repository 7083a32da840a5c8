"""`serve_app` binds its port before it builds the app and starts its runtime (an actor's vLLM engine takes
tens of seconds, and a port chosen free by the parent could meanwhile go to another socket), then serves on
that socket and stops through the exit hook it installs."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from offpolicy.buffer.embedded import free_port
from offpolicy.services.common.app import serve_app
from offpolicy.services.common.background import ExitAfterGrace
from offpolicy.services.common.settings import LearnerServiceSettings


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """`serve_app` configures the process's logging (as a service's main does): put it back after."""
    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}  # fmt: skip
    converter = logging.Formatter.converter
    yield
    for n, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers[:], logger.propagate = handlers, propagate
        logger.setLevel(level)
    logging.Formatter.converter = converter


def test_the_port_is_bound_before_the_app_is_built_and_served_on(logging_restored: None) -> None:
    port = free_port()
    taken: list[bool] = []
    fatal = ExitAfterGrace(grace_s=0.0)

    def create_app(settings: LearnerServiceSettings) -> FastAPI:
        with socket.socket() as other:  # another socket wants the port meanwhile
            try:
                other.bind(("127.0.0.1", port))
                taken.append(False)
            except OSError:
                taken.append(True)
        app = FastAPI()
        app.state.redactor = None
        app.state.fatal_exit = fatal

        @app.get("/ping")
        def ping() -> dict[str, bool]:
            return {"ok": True}

        return app

    settings = LearnerServiceSettings(host="127.0.0.1", port=port, log_json=False)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(serve_app(settings, create_app)), daemon=True)
    thread.start()
    deadline, answer = time.monotonic() + 20, None
    while answer is None and time.monotonic() < deadline:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/ping", timeout=1.0).json()
        except httpx.TransportError:
            time.sleep(0.1)
    assert taken == [True]  # the port was the service's before its app was built
    assert answer == {"ok": True}  # and it serves on that socket
    assert fatal.request_exit is not None
    fatal.request_exit(0)  # as a dead loop's grace or SIGTERM ends it
    thread.join(timeout=10)
    assert not thread.is_alive() and status == [0]
