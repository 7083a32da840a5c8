"""Start the learner and actor services as child processes, wait until they are ready, stop them by handle.

Used by `offpolicy quickstart`, the e2e tests and `benchmarks/e2e.py`. Each child runs in its own process
group (so a Ctrl-C at the terminal reaches only the parent, which then stops the children in order) and
logs to a file whose tail is quoted when it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from offpolicy.buffer.embedded import free_port
from offpolicy.services.common.errors import ChildProcessFailed

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServiceProcess:
    """One running service child: its `Popen` handle, base URL and log file."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll `/readyz` until 200; raise `ChildProcessFailed` (with the log tail) on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ChildProcessFailed(
                    f"{self.name} exited with code {self.proc.returncode} while starting; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet: poll again until the deadline
            time.sleep(poll_s)
        raise ChildProcessFailed(
            f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful: the service finishes its step and exits), SIGKILL after `timeout_s`; then
        SIGKILL whatever is left of the child's process group (a vLLM engine core or worker that outlived
        it). The group is the one `start_service` created for this child, so this is still by handle."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # an empty group: nothing outlived the child
            os.killpg(self.proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session=True
        if self._log_file is not None:
            self._log_file.close()
        return self.proc.returncode


def start_service(
    kind: str,
    config_path: Path,
    log_path: Path,
    *,
    port: int | None = None,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> ServiceProcess:
    """Start `offpolicy <kind> --config <config_path> [args]` on `port` (a free one when None) as a child,
    with `env` over this process's environment (e.g. its CUDA_VISIBLE_DEVICES)."""
    port = port or free_port()
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = log_path.open("ab")
    cmd = [
        sys.executable,
        "-m",
        "offpolicy.services.cli",
        kind,
        "--config",
        str(config_path),
        "--port",
        str(port),
        *(args or []),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=child_env,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    return ServiceProcess(kind, proc, f"http://127.0.0.1:{port}", log_path, log_file)
