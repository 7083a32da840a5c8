"""The quickstart refuses, before anything starts, a learner whose memory plan does not fit its GPU (the
plan `offpolicy config check` makes; the GPU's size given as `--gpu-memory-gib`, no GPU here), naming the
fixes with their plans; on CPU (no `--gpus`) nothing is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from offpolicy.services.cli import main
from offpolicy.services.quickstart import run as quickstart
from offpolicy.services.quickstart.fit import refusal
from offpolicy.services.quickstart.run import QuickstartOptions
from tests.data.models import QWEN_7B_CONFIG, write_config


@pytest.fixture
def seven_b(tmp_path: Path) -> Path:
    """Qwen2.5-7B-Instruct's config.json alone (the plan reads no weight)."""
    return write_config(tmp_path / "Qwen2.5-7B-Instruct", QWEN_7B_CONFIG)


def test_a_full_weight_7b_on_one_learner_gpu_is_refused_before_anything_starts(
    seven_b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    runs = tmp_path / "runs"
    for gib in ("80", "141"):
        argv = ["quickstart", "--model", str(seven_b), "--dataset", str(data), "--reward", "exact_match",
                "--gpus", "0,1", "--gpu-memory-gib", gib, "--runs-dir", str(runs)]  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "the learner's memory plan needs ~140.8 GiB per GPU" in err, err
        assert f"on 1 GPU(s) of {gib} GiB" in err and "the learner would refuse it at start" in err
        assert "--lora (a LoRA adapter on the frozen model:" in err
        assert "more GPUs for the learner: 3 or more in --gpus" in err  # the learner on 2, FSDP2
        assert "a smaller --model (this one has 7,615,616,512 parameters)" in err
        assert (
            "Not lower token budgets (micro_batch_tokens, now 16384; logprob_chunk_tokens, now 4096)" in err
        )
    assert not runs.exists()  # refused before the run folder, Redis or a child


def test_what_the_refusal_names_fits(seven_b: Path):
    assert refusal(str(seven_b), 1, True, 80) is None  # --lora on one learner GPU
    assert refusal(str(seven_b), 2, False, 80) is None  # full weights on two (--gpus 0,1,2,3)
    assert refusal(str(seven_b), 2, False, 40) is not None
    # on two GPUs of 75 GiB the token budgets are what is over: a learner config of lower ones fits
    over = refusal(str(seven_b), 2, False, 75)
    assert over is not None and "logprob_chunk_tokens, now 4096) in a learner config of your own" in over


def test_on_cpu_nothing_is_checked(seven_b: Path, monkeypatch: pytest.MonkeyPatch):
    """No --gpus: the CPU engine, no GPU to fit; --gpus without CUDA here and no size given: the learner's
    own check at start stays."""
    assert quickstart._memory_refusal(QuickstartOptions(model=str(seven_b))) is None
    assert quickstart._memory_refusal(QuickstartOptions(gpus=(0, 1))) is None  # the tiny model
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert quickstart._memory_refusal(QuickstartOptions(model=str(seven_b), gpus=(0, 1))) is None
    given = QuickstartOptions(model=str(seven_b), gpus=(0, 1), gpu_memory_gib=80)
    assert quickstart._memory_refusal(given) is not None
    assert "pass --gpus too" in QuickstartOptions(gpu_memory_gib=80).refusal()
