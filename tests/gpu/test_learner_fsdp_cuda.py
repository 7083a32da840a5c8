"""The learner on N GPUs (torchrun, FSDP2, NCCL; skipped without a GPU; `make test-gpu` runs these): the
sharded runs train like the one-process learner on the same groups, and FSDP2 on one GPU costs about what
the one-process learner does (benchmarks/learner_fsdp.py, whose figures these check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "learner_fsdp.py"), "--device", "cuda", *args, "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sharded_runs_match_one_process_in_fp32():
    nproc = min(2, torch.cuda.device_count())
    got = bench("--shape", "cpu-small", "--precision", "fp32", "--nproc", str(nproc))
    assert got["backend"] == "nccl" and got["weights_moved"] > 1e-4
    assert got["max_abs_weight_diff"] <= 1e-5 and got["max_abs_weight_diff_fsdp_1"] <= 1e-5
    # lean start: the shards go to the GPUs, host memory holds at most a tensor's rows in transit
    assert got["startup_host_bytes_per_rank_ratio"] <= 0.6
    assert got["startup_host_bytes_per_rank_ratio"] < got["startup_host_bytes_per_rank_ratio_eager"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two nodes of one GPU each need 2 GPUs")
def test_two_torchrun_agents_on_cuda_match_one_process():
    got = bench("--shape", "cpu-small", "--precision", "fp32", "--nproc", "2", "--nnodes", "2")
    assert got["max_abs_weight_diff_nnodes"] <= 1e-5 and got["weights_moved"] > 1e-4


def test_fsdp_on_one_gpu_costs_what_one_process_does():
    got = bench("--shape", "1.3b", "--nproc", "1", "--steps", "4")
    assert got["fsdp1_vs_single_step_ratio"] <= 1.10, got["runs"]
    assert got["startup_host_bytes_per_rank_ratio"] <= 0.6  # the 1.3b shape's start-up, lean
