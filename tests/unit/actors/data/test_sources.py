"""Datasets as users have them: verl's GSM8K parquet, TRL's conversational jsonl, a `datasets` folder
written by save_to_disk and plain jsonl read to the same prompts; keys, dotted paths, system prompts; bad
records named by row and key; `offpolicy data preview`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from offpolicy.actors.config import DatasetConfig
from offpolicy.actors.data.prompts import Prompt, chat_messages, encode, load_prompts, render
from offpolicy.actors.errors import DatasetError
from offpolicy.learner.model import build_char_tokenizer, make_tiny_model
from offpolicy.services.cli import main
from tests.data.gsm8k import DISK_FIXTURE, PROBLEMS, plain_rows, question, solution, trl_rows, verl_rows


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def layouts(tmp_path):
    """The same three problems in each layout, with the settings that read it."""
    return {
        "plain": DatasetConfig(path=_jsonl(tmp_path / "plain.jsonl", plain_rows()), chat_template=True),
        "verl": DatasetConfig.verl(_parquet(tmp_path / "gsm8k.parquet", verl_rows())),
        "trl": DatasetConfig.trl(_jsonl(tmp_path / "trl.jsonl", trl_rows())),
        "disk": DatasetConfig.verl(str(DISK_FIXTURE), split="train"),
    }


def test_every_layout_reads_to_the_same_prompts(layouts):
    tok = build_char_tokenizer()
    seen = {}
    for name, cfg in layouts.items():
        prompts = load_prompts(cfg)
        seen[name] = [
            (p.prompt_id, p.text, p.answer, encode(tok, p, cfg.chat_template, "be brief")) for p in prompts
        ]
    expected_texts = [question(i) for i in range(len(PROBLEMS))]
    assert [t for _, t, _, _ in seen["plain"]] == expected_texts
    assert [a for _, _, a, _ in seen["plain"]] == ["72", "10", "5"]
    for name in ("verl", "trl", "disk"):
        assert seen[name] == seen["plain"], name
    rendered = render(tok, load_prompts(layouts["verl"])[0], True, "be brief")
    assert rendered == f"system: be brief\nuser: {question(0)}\nassistant: "


def test_verl_metadata_ids_and_messages(layouts):
    first = load_prompts(layouts["verl"])[0]
    assert first.messages == ({"role": "user", "content": question(0)},)
    assert (first.metadata["data_source"], first.metadata["ability"]) == ("openai/gsm8k", "math")
    assert json.loads(first.metadata["extra_info"])["index"] == 0  # what verl's compute_score reads
    assert first.prompt_id == "0"
    assert load_prompts(layouts["plain"])[0].messages is None
    nested = DatasetConfig.verl(
        layouts["verl"].path, metadata_keys=["extra_info.split", "reward_model"], optional_metadata_keys=[]
    )
    assert load_prompts(nested)[1].metadata == {
        "extra_info.split": "train",
        "reward_model": json.dumps({"style": "rule", "ground_truth": "10"}),
    }


def test_the_verl_preset_in_yaml_and_rows_without_ability(tmp_path):
    """`preset: verl` in a config file is `DatasetConfig.verl`; keys beside it win; `ability` and
    `extra_info` are kept when a row has them and not required; an unknown preset names its field."""
    import yaml
    from pydantic import ValidationError

    rows = [{k: v for k, v in r.items() if k != "ability"} for r in verl_rows()]
    rows[1].pop("extra_info")
    path = _parquet(tmp_path / "no_ability.parquet", rows)
    cfg = DatasetConfig.model_validate(yaml.safe_load(f"path: {path}\npreset: verl\n"))
    assert cfg == DatasetConfig.verl(path)
    assert cfg.answer_key == "reward_model.ground_truth" and cfg.chat_template is True
    assert (
        DatasetConfig.model_validate({"path": path, "preset": "verl", "chat_template": False}).chat_template
        is False
    )
    first, second, _ = load_prompts(cfg)
    assert first.answer == "72" and "ability" not in first.metadata and "extra_info" in first.metadata
    assert second.metadata == {"data_source": "openai/gsm8k"} and second.prompt_id == "1"  # its index
    with pytest.raises(ValidationError) as e:
        DatasetConfig.model_validate({"path": path, "preset": "verll"})
    assert e.value.errors()[0]["loc"] == ("preset",)


def test_disk_folder_splits():
    cfg = DatasetConfig.verl(str(DISK_FIXTURE))
    with pytest.raises(DatasetError, match=r"splits \['train', 'test'\]: set dataset.split"):
        load_prompts(cfg)
    assert len(load_prompts(cfg.model_copy(update={"split": "test"}))) == 1
    with pytest.raises(DatasetError, match="'dev' is not one of them"):
        load_prompts(cfg.model_copy(update={"split": "dev"}))
    one = load_prompts(cfg.model_copy(update={"path": str(DISK_FIXTURE / "train")}))
    assert [p.answer for p in one] == ["72", "10", "5"]


def test_disk_folder_written_by_datasets_now(tmp_path):
    """The committed folder was written by datasets 5.2; the installed version, where there is one."""
    datasets = pytest.importorskip("datasets")
    table = datasets.table.InMemoryTable(pa.Table.from_pylist(verl_rows()))
    datasets.Dataset(table, fingerprint="gsm8k").save_to_disk(str(tmp_path / "d"))  # no hashing: see gsm8k.py
    assert [p.answer for p in load_prompts(DatasetConfig.verl(str(tmp_path / "d")))] == ["72", "10", "5"]


def test_trl_completion_and_messages_layouts(tmp_path):
    user = {"role": "user", "content": question(0)}
    done = {"role": "assistant", "content": PROBLEMS[0][1]}
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": [user], "completion": [done]}])
    (pc,) = load_prompts(DatasetConfig.trl(path, answer_key="completion"))
    path = _jsonl(tmp_path / "lm.jsonl", [{"messages": [user, done]}])
    (lm,) = load_prompts(DatasetConfig.trl(path, prompt_key="messages"))
    for p in (pc, lm):
        assert (p.messages, p.text, p.answer) == ((user,), question(0), PROBLEMS[0][1])


def test_system_prompts(tmp_path):
    tok = build_char_tokenizer()
    rows = [
        {"prompt": "hi", "sys": "row system"},
        {"prompt": "hi", "sys": None},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}], "sys": "x"},
    ]
    cfg = DatasetConfig(path=_jsonl(tmp_path / "s.jsonl", rows), chat_template=True, system_prompt_key="sys")
    a, b, c = load_prompts(cfg)
    assert chat_messages(a, "config system")[0] == {"role": "system", "content": "row system"}
    assert chat_messages(b, "config system")[0] == {"role": "system", "content": "config system"}
    assert chat_messages(c, "config system")[0] == {"role": "system", "content": "own"}  # its own wins
    assert tok.decode(encode(tok, b, True, None)) == "user: hi\nassistant: "


@pytest.mark.parametrize(
    ("row", "settings", "match"),
    [
        ({"question": "q"}, {}, r"row 0: no `prompt` \(dataset.prompt_key\); the record has \['question'\]"),
        ({"prompt": [{"role": "user"}]}, {}, "message 0 must be an object with string `role` and `content`"),
        ({"prompt": [{"role": "system", "content": "s"}]}, {}, "no user message"),
        ({"prompt": [{"role": "user", "content": "q"}]}, {"chat_template": False}, "chat_template: true"),
        ({"prompt": "q"}, {"metadata_keys": ["extra_info.index"]}, r"no `extra_info.index`"),
        ({"prompt": "q", "s": 3}, {"system_prompt_key": "s"}, "must be a string or null"),
        ({"prompt": 7}, {}, "non-empty string or a list of chat messages"),
    ],
)
def test_bad_records_name_the_row_and_the_key(tmp_path, row, settings, match):
    path = _parquet(tmp_path / "bad.parquet", [row])
    with pytest.raises(DatasetError, match=match):
        load_prompts(DatasetConfig(path=path, **({"chat_template": True} | settings)))


def test_paths_that_are_not_datasets(tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(DatasetError, match="not one written by `datasets`"):
        load_prompts(str(tmp_path / "folder"))
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "nope" / "data"))
    if importlib.util.find_spec("datasets") is None:  # a hub id without the `hf` extra (no network)
        with pytest.raises(DatasetError, match=r"pip install 'offpolicy\[hf\]'"):
            load_prompts("openai/gsm8k")


def test_prompt_keeps_positional_construction():
    p = Prompt(0, "p", "text", "a", {"k": "v"})
    assert (p.messages, p.system) == (None, None)


# --- offpolicy data preview


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_preview_prints_records_rendered_tokens_and_answers(tmp_path, tiny_model, capsys):
    path = _parquet(tmp_path / "gsm8k.parquet", verl_rows())
    assert main(["data", "preview", path, "--preset", "verl", "--model", tiny_model, "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: 3 records, 3 with an answer (`reward_model.ground_truth`)")
    assert f"user: {question(0)}\nassistant: " in out
    assert "answer: '72'" in out and "answer: '10'" in out and "record 2" not in out
    tokens = len(f"user: {question(0)}\nassistant: ")  # the char tokenizer: one token per character
    assert f"rendered ({tokens} tokens):" in out

    assert main(["data", "preview", path, "--preset", "verl", "--model", tiny_model, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["records"], report["with_answer"]) == (3, 3)
    assert [r["answer"] for r in report["first"]] == [solution(i) for i in range(3)]
    assert report["first"][0]["tokens"] == tokens


def test_preview_with_an_actor_config_and_key_flags(tmp_path, tiny_model, capsys):
    path = _jsonl(tmp_path / "q.jsonl", [{"question": "1+1?", "sol": {"value": 2}}, {"question": "2+2?"}])
    config = tmp_path / "actor.yaml"
    config.write_text(
        f"model_path: {tiny_model}\ndataset: {{path: elsewhere.jsonl, chat_template: true, "
        "system_prompt: be brief}\n"
    )
    argv = ["data", "preview", path, "--config", str(config), "--prompt-key", "question"]
    assert main([*argv, "--answer-key", "sol.value"]) == 0
    out = capsys.readouterr().out
    assert "2 records, 1 with an answer (`sol.value`)" in out
    assert "WARNING: 1 records have no `sol.value`" in out
    assert "system: be brief\nuser: 1+1?\nassistant: " in out and "answer: '2'" in out


def test_preview_fails_with_the_reason(tmp_path, capsys):
    path = _jsonl(tmp_path / "q.jsonl", [{"prompt": "a"}, {"question": "b"}])
    assert main(["data", "preview", path]) == 1
    assert "q.jsonl:2: no `prompt` (dataset.prompt_key)" in capsys.readouterr().err
    assert main(["data", "preview", str(tmp_path / "missing.parquet")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_preview_command_line(tmp_path):
    """The installed entry point's path: `python -m offpolicy.services.cli data preview`."""
    path = _jsonl(tmp_path / "p.jsonl", plain_rows())
    done = subprocess.run(
        [sys.executable, "-m", "offpolicy.services.cli", "data", "preview", path, "-n", "1"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{path}: 3 records, 3 with an answer (`answer`)")
