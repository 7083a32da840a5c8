"""The background publish gather never waits for the training's stream (persist/background_gather.py: why
gloo from host memory): with ~2 s of work queued on the training stream of one NCCL rank, the gather of
the host snapshot completes while that work still runs, and rank 0 has the weights. Before, the gather's
bucket copies rode the device's default stream behind the training kernels (on 2+ ranks: a deadlock with
FSDP2's collectives)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from offpolicy.learner.model import make_tiny_model

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_background_gather_does_not_wait_for_the_training_stream(tmp_path):
    model = make_tiny_model(
        tmp_path / "model", hidden_size=256, num_heads=4, num_layers=3, intermediate_size=1024
    )
    out = tmp_path / "result.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(HERE / "publish_gather_rank.py"), str(model), str(out)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "nccl" and result["publish_backend"] == "gloo"
    assert result["names_match"] and result["max_abs_diff"] == 0.0 and result["buckets"] >= 2
    assert result["stream_busy_after_gather"], result  # done before the queued training work
    assert result["queued_work_left_s"] > 0.2, result
