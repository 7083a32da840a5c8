"""`offpolicy config check` offline: the shipped toy configs pass and print the memory plan; a broken pair
fails with every reason at once (field paths, an unimportable reward, verl's parquet read with the
default keys naming the preset, a plan past the GPU)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.cli import main
from tests.data.gsm8k import verl_rows

CONFIGS = Path(__file__).resolve().parents[4] / "configs"


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the toy configs' `runs/tiny-model` and a prompt file, as the working directory."""
    make_tiny_model(tmp_path / "runs" / "tiny-model")
    write_target_token_dataset(tmp_path / "prompts.jsonl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OFFPOLICY_DATASET__PATH", "prompts.jsonl")  # the toy actor's is a container path
    return tmp_path


def test_the_toy_configs_pass_and_the_plan_is_printed(here: Path, capsys: pytest.CaptureFixture[str]):
    learner, actor = str(CONFIGS / "learner.yaml"), str(CONFIGS / "actor.yaml")
    assert main(["config", "check", learner, actor, "--gpus", "8", "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "memory plan:" in out and "per rank on 8 GPU(s) (FSDP2" in out and "fits 90% of 80 GiB" in out
    assert "reward: math_answer (signature text)" in out and out.rstrip().endswith("every check passed")
    units = next(line for line in out.splitlines() if line.startswith("units: "))  # versions vs learner steps
    assert (
        "a policy version is one optimizer step; a learner step takes" in units and "learner step(s)" in units
    )
    assert main(["config", "check", learner]) == 0  # the learner alone


def test_a_broken_pair_fails_with_every_reason(here: Path, capsys: pytest.CaptureFixture[str]):
    pq.write_table(pa.Table.from_pylist(verl_rows()), here / "gsm8k.parquet")
    learner = yaml.safe_load((CONFIGS / "learner.yaml").read_text())
    learner["optimizer"]["lr"] = -1
    learner["micro_batch_tokens"] = "lots"
    actor = yaml.safe_load((CONFIGS / "actor.yaml").read_text())
    actor["reward"]["name"] = "my_missing_module.compute_score"
    actor["run_id"] = "other"
    (here / "learner.yaml").write_text(yaml.safe_dump(learner))
    (here / "actor.yaml").write_text(yaml.safe_dump(actor))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFPOLICY_DATASET__PATH", "gsm8k.parquet")  # verl's layout, read with the default keys
        assert main(["config", "check", "learner.yaml", "actor.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("5 problem(s):")  # micro_batch_tokens: neither an integer nor "auto" (2 errors)
    assert "learner.yaml: optimizer.lr: Input should be greater than 0" in err
    assert "learner.yaml: micro_batch_tokens" in err
    assert "actor.yaml: reward.name: reward 'my_missing_module.compute_score': cannot import" in err
    assert "dataset.preset: verl" in err
    # the learner did not validate, so no cross-file check; with a valid one, run_id disagrees
    (here / "learner.yaml").write_text((CONFIGS / "learner.yaml").read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFPOLICY_DATASET__PATH", "gsm8k.parquet")
        mp.setenv("OFFPOLICY_DATASET__PRESET", "verl")
        assert main(["config", "check", "learner.yaml", "actor.yaml", "--gpu-memory-gib", "0.01"]) == 1
    err = capsys.readouterr().err
    assert "run_id: 'other' differs from the learner's 'default'" in err
    assert "memory plan: the memory plan needs" in err and "dataset" not in err


def test_a_model_that_is_not_here_is_a_reason_not_a_download(here: Path, capsys: pytest.CaptureFixture[str]):
    learner = yaml.safe_load((CONFIGS / "learner.yaml").read_text())
    learner["model_path"] = str(here / "no-such-model")
    (here / "learner.yaml").write_text(yaml.safe_dump(learner))
    assert main(["config", "check", "learner.yaml"]) == 1
    assert "model_path: its config.json cannot be read here" in capsys.readouterr().err


def test_a_model_folder_without_its_tokenizer_is_a_reason_naming_the_files(here: Path, capsys):
    """Weights copied without the tokenizer: named at check time (not, later, as advice to drop the chat
    template, which would train an Instruct model on raw text)."""
    from offpolicy.learner.model.load import load_tokenizer

    model = here / "runs" / "tiny-model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    assert main(["config", "check", str(CONFIGS / "learner.yaml")]) == 1
    err = capsys.readouterr().err
    assert "model_path:" in err and "holds no tokenizer (none of tokenizer.json, tokenizer_config.json" in err
    with pytest.raises(FileNotFoundError, match="huggingface-cli download <hub id> --include 'tokenizer"):
        load_tokenizer(model)


def test_each_run_of_an_actor_pool_is_checked_and_the_learner_may_be_any_of_its_runs(
    here: Path, capsys: pytest.CaptureFixture[str]
):
    actor = yaml.safe_load((CONFIGS / "actor.yaml").read_text())
    actor["engine"]["lora"] = {"max_rank": 8, "max_loras": 2, "max_cpu_loras": 4}
    second = {"run_id": "second", "dataset": {"path": "missing.jsonl"}, "reward": {"name": "nope.fn"}}
    actor["runs"] = [second]
    learner = yaml.safe_load((CONFIGS / "learner.yaml").read_text()) | {"run_id": "second"}
    (here / "actor.yaml").write_text(yaml.safe_dump(actor))
    (here / "learner.yaml").write_text(yaml.safe_dump(learner))
    assert main(["config", "check", "learner.yaml", "actor.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("2 problem(s):"), err  # run 'second''s reward and dataset; its run_id is served
    assert "actor.yaml runs.0: reward.name: reward 'nope.fn': cannot import" in err
    assert "actor.yaml runs.0: dataset" in err and "run_id" not in err
