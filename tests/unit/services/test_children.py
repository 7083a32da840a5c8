"""`ServiceProcess.stop` leaves nothing of the child's process group behind (a vLLM engine core used to)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from offpolicy.services.children import ServiceProcess

# The child starts a grandchild that ignores SIGTERM (as a busy engine-core process effectively does),
# prints its pid, and exits on SIGTERM itself: the grandchild would be orphaned.
# The handler is installed before the pid is printed: the test's SIGTERM may follow at once.
CHILD = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
g = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
print(g.pid, flush=True)
signal.pause()
"""


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (PID 1 in a container may not reap at once)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_stop_kills_what_the_child_left_in_its_group(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, start_new_session=True)
    grandchild = int(proc.stdout.readline())
    assert _alive(grandchild)
    service = ServiceProcess("child", proc, "http://127.0.0.1:1", log)

    assert service.stop(timeout_s=10) == 0  # the child itself exited gracefully on SIGTERM

    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the grandchild outlived stop()"
    proc.stdout.close()


def test_stop_on_an_exited_child_is_a_no_op(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(10)
    # The child's group is already empty: stop() must not raise ProcessLookupError.
    assert ServiceProcess("done", proc, "http://127.0.0.1:1", tmp_path / "x.log").stop() == 0
