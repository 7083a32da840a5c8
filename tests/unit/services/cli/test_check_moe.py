"""`offpolicy config check` on Qwen3-30B-A3B (its committed config.json, deploy/models/qwen3-30b-a3b) on
8 x 80 GiB: the plan fits and counts the experts: total and active parameters, the routed experts' state
per rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from offpolicy.services.cli import main

ROOT = Path(__file__).resolve().parents[4]
QWEN3_30B = ROOT / "deploy" / "models" / "qwen3-30b-a3b"


def test_qwen3_30b_a3b_is_sized_on_eight_80_gib_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    learner = yaml.safe_load((ROOT / "configs" / "learner.yaml").read_text())
    learner["model_path"] = str(QWEN3_30B)
    (tmp_path / "learner.yaml").write_text(yaml.safe_dump(learner))
    assert (
        main(["config", "check", str(tmp_path / "learner.yaml"), "--gpus", "8", "--gpu-memory-gib", "80"])
        == 0
    )
    out = capsys.readouterr().out
    print(out)
    assert "per rank on 8 GPU(s) (FSDP2, 30,532,122,624 parameters" in out and "fits 90% of 80 GiB" in out
    experts = next(line for line in out.splitlines() if line.startswith("experts:"))
    assert "128 routed, top 8, in 48 of 48 layers" in experts and "3,353,032,704 active per token" in experts
    weights = float(re.search(r"whose weights ([\d.]+)", experts).group(1))
    assert weights == pytest.approx(48 * 128 * 3 * 2048 * 768 * 4 / 8 / 2**30, abs=0.05)  # fp32, an eighth
    # one GPU cannot hold it: the same config refused with the plan's reasons
    assert main(["config", "check", str(tmp_path / "learner.yaml"), "--gpu-memory-gib", "80"]) == 1
    assert "memory plan: the memory plan needs" in capsys.readouterr().err
