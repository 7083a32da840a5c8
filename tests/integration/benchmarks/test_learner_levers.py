"""`benchmarks/learner.py --levers`: the per-lever table's runs, on the smoke shape on CPU. Each row adds
one lever to the row before, and the learner's reported settings show that lever, and only it, changed
(the GPU figures come from the same command with `--device cuda` and no `--smoke`: docs/benchmarks.md).
`--profile` adds the last row's step by kind of operator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_each_row_adds_its_lever_to_the_row_before(tmp_path):
    run = subprocess.run(
        [sys.executable, "benchmarks/learner.py", "--shape", "longtail-4b", "--smoke", "--levers", "--json",
         "--profile", "--device", "cpu", "--model-dir", str(tmp_path / "model")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    rows = out["levers"]
    # CPU: the compiled row is left out
    assert [r["lever"] for r in rows] == [
        "baseline", "+ varlen attention (auto)", "+ fused log-prob head", "+ checkpointing auto (per layer)",
        "+ budgets auto (training, pi_old)",
    ]  # fmt: skip
    assert all("error" not in r and min(r["step_s"], r["tokens_per_s"], r["warmup_s"]) > 0 for r in rows)
    s = [r["settings"] | {"attention": r["attention"]} for r in rows]
    baseline = {"attention": "sdpa_varlen", "logprob_head": "chunked", "checkpointed_layers": 2,
                "decoder_layers": 2, "micro_batch_tokens": 16384, "compile_layers": False}  # fmt: skip
    assert s[0] == s[0] | baseline
    assert s[1]["logprob_head"] == "chunked" and s[2]["logprob_head"] == "fused"
    # no device limit on CPU: `auto` checkpoints nothing, and the budgets are the default
    assert s[2]["checkpointed_layers"] == 2 and s[3]["checkpointed_layers"] == 0
    assert s[4]["micro_batch_tokens"] == 16384 and s[4]["no_grad_micro_batch_tokens"] == 16384
    changed = [{k for k in s[i] if s[i][k] != s[i - 1][k]} for i in range(1, len(s))]
    assert changed[1] == {"logprob_head"} and changed[2] == {"gradient_checkpointing", "checkpointed_layers"}
    assert out["speedup_vs_baseline"] > 0 and out["mfu"] is None  # MFU: CUDA only
    # `--profile`: the last row's one more step, its operators by kind (kernels on CUDA)
    prof = out["profile"]
    assert prof["measured"] == "cpu_operators" and prof["device_busy_share"] is None
    assert prof["kinds"]["matmul"]["s"] > 0 and prof["kinds"]["attention"]["s"] > 0
    assert "profile" not in rows[-1]
