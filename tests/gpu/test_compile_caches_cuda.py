"""A GPU learner compiles its fused head on a read-only root filesystem (the Kubernetes manifests' pods set
TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR on a writable volume: tests/unit/deploy/test_k8s.py renders
that): given those caches, the compile writes into them and never into HOME (read-only here, where Triton's
default ~/.triton/cache crashed the first step). In a fresh interpreter: the caches are read from the
environment at the first compile."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

COMPILE = """
import torch
from offpolicy.learner.model.head import head_logprobs
head = torch.nn.Linear(256, 4096, bias=False, device="cuda")
h = torch.randn(64, 256, device="cuda", requires_grad=True)
ids = torch.randint(0, 4096, (64,), device="cuda")
lp, _ = head_logprobs(head, h, ids, torch.ones(64, 1, device="cuda"), None, False)
lp.sum().backward()
torch.cuda.synchronize()
print("compiled")
"""


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def test_the_fused_head_compiles_into_the_caches_it_is_given_and_writes_nothing_in_home(tmp_path):
    home = tmp_path / "home"  # read-only: any write there (Triton's ~/.triton/cache) fails the compile
    home.mkdir()
    home.chmod(stat.S_IRUSR | stat.S_IXUSR)
    caches = tmp_path / "caches"  # the manifests' writable volume
    env = {
        **os.environ,
        "HOME": str(home),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "torchinductor"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-4000:]
    assert files_under(caches / "triton"), "Triton wrote no kernel into TRITON_CACHE_DIR"
    assert files_under(caches / "torchinductor"), "inductor wrote nothing into its cache"
    assert not files_under(home)
