"""Running this checkout's code on N local torchrun ranks (standalone rendezvous, one thread per rank):
the argv and environment every multi-rank integration test uses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
SCRIPTS = Path(__file__).resolve().parent  # the `*_ranks.py` scripts torchrun runs


def torchrun_argv(*args: str, nproc: int = 2) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N ARGS...` (a script and its
    arguments, or `-m module ...`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH and one OpenMP thread per rank."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def run_script(name: str, *args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `NAME`, a `*_ranks.py` script of this folder, on `nproc` ranks to the end; asserts it exited 0
    (its output's tail in the message)."""
    script = str(SCRIPTS / name)
    proc = subprocess.run(
        torchrun_argv(script, *args, nproc=nproc),
        cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@contextmanager
def leader_learner(config_path: str) -> Iterator:
    """Inside a rank script: the learner of `config_path` on this rank (CUDA when the config's device
    says so); the leader gets it to drive, a follower follows the leader until it stops (and gets None);
    every rank closes it at the end."""
    from offpolicy.learner.config import load_config
    from offpolicy.learner.distributed import current, init_from_env
    from offpolicy.learner.trainer import Learner

    config = load_config(config_path, {})
    init_from_env("cuda" if (config.device or "").startswith("cuda") else "cpu")
    learner = Learner(config)
    try:
        if current().is_leader:
            yield learner
        else:
            learner.run_follower()
            yield None
    finally:
        learner.close()
