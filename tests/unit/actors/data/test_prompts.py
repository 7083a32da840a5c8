"""Prompt datasets: jsonl/parquet loading, sharding that covers every record once per epoch, reshuffles;
the toy datasets (target-token prompts, sums for the calculator) and which one the quickstart writes."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from offpolicy.actors.data.prompts import Prompt, encode, epoch_batches, load_prompts, shard
from offpolicy.actors.data.toy import write_sums_dataset, write_target_token_dataset
from offpolicy.actors.errors import DatasetError
from offpolicy.learner.model import build_char_tokenizer


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_fields_ids_and_metadata(tmp_path):
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "1+1=", "answer": 2, "metadata": {"src": "x", "level": 3}},
            {"prompt": "hi", "id": "p-7"},
        ],
    )
    a, b = load_prompts(path)
    assert (a.index, a.prompt_id, a.text, a.answer, a.metadata) == (
        0,
        "0",
        "1+1=",
        "2",
        {"src": "x", "level": "3"},
    )
    assert (b.index, b.prompt_id, b.answer, b.metadata) == (1, "p-7", None, {})


def test_parquet_matches_jsonl(tmp_path):
    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    from_parquet = load_prompts(tmp_path / "d.parquet")
    from_jsonl = load_prompts(_write_jsonl(tmp_path / "d.jsonl", records))
    assert from_parquet == from_jsonl


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"answer": "1"}\n', "prompt"),
        ('{"prompt": ""}\n', "prompt"),
        ('{"prompt": "a", "metadata": [1]}\n', "metadata"),
        ("[1]\n", "object"),
        ("{not json\n", "not JSON"),
        ("\n", "no records"),
    ],
)
def test_bad_records_are_named(tmp_path, content, match):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=match):
        load_prompts(path)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(DatasetError, match=r"jsonl or \.parquet"):
        load_prompts(tmp_path / "d.csv")


@pytest.mark.parametrize("num_actors", [1, 2, 3, 7])
def test_shards_cover_every_prompt_once_per_epoch(tmp_path, num_actors):
    prompts = load_prompts(_write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(20)]))
    for epoch in range(3):
        seen = []
        for actor in range(num_actors):
            mine = shard(prompts, actor, num_actors)
            assert all(p.index % num_actors == actor for p in mine)
            seen += [p.index for batch in epoch_batches(mine, 3, epoch, seed=5, shuffle=True) for p in batch]
        assert sorted(seen) == list(range(20))


def test_epochs_reshuffle_deterministically(tmp_path):
    prompts = load_prompts(_write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(12)]))

    def order(epoch, seed=0, shuffle=True):
        return [p.index for b in epoch_batches(prompts, 5, epoch, seed, shuffle) for p in b]

    assert [len(b) for b in epoch_batches(prompts, 5, 0, 0, True)] == [5, 5, 2]
    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0, shuffle=False) == list(range(12))


def test_shard_rejects_bad_index(tmp_path):
    with pytest.raises(ValueError, match="actor_index=2"):
        shard([], 2, 2)


def test_encode_plain_and_chat_template():
    tok = build_char_tokenizer()
    prompt = Prompt(index=0, prompt_id="0", text="hi")
    plain = encode(tok, prompt, chat_template=False, system_prompt=None)
    assert tok.decode(plain) == "hi"
    chat = encode(tok, prompt, chat_template=True, system_prompt="be brief")
    assert tok.decode(chat) == "system: be brief\nuser: hi\nassistant: "


def test_toy_dataset(tmp_path):
    path = write_target_token_dataset(tmp_path / "toy.jsonl", num_prompts=10, target="b")
    prompts = load_prompts(path)
    assert [p.prompt_id for p in prompts] == [f"toy-{i}" for i in range(10)]
    assert all(p.answer == "b" and "b" in p.text for p in prompts)
    with pytest.raises(ValueError, match="one character"):
        write_target_token_dataset(tmp_path / "x.jsonl", target="ab")


def test_sums_dataset(tmp_path):
    path = write_sums_dataset(tmp_path / "sums.jsonl", num_prompts=50, seed=3)
    prompts = load_prompts(path)
    assert [p.prompt_id for p in prompts] == [f"sum-{i}" for i in range(50)]
    for p in prompts:
        found = re.fullmatch(r"What is (\d+)\+(\d+)\?", p.text)
        assert found is not None, p.text
        a, b = int(found.group(1)), int(found.group(2))
        assert 1 <= a <= 9 and 1 <= b <= 9 and p.answer == str(a + b)
    assert len({p.text for p in prompts}) > 25  # varied sums, not one repeated
    again = write_sums_dataset(tmp_path / "again.jsonl", num_prompts=50, seed=3)
    assert again.read_text() == path.read_text()  # seeded
    assert (
        write_sums_dataset(tmp_path / "other.jsonl", num_prompts=50, seed=4).read_text() != path.read_text()
    )
    small = load_prompts(write_sums_dataset(tmp_path / "small.jsonl", num_prompts=20, max_operand=3))
    assert {len(p.answer) for p in small} == {1}  # at most 3+3
    with pytest.raises(ValueError, match="max_operand"):
        write_sums_dataset(tmp_path / "x.jsonl", max_operand=0)


def test_the_quickstart_writes_sums_for_the_calculator(tmp_path):
    from offpolicy.services.quickstart.configs import toy_dataset

    calc = load_prompts(
        toy_dataset(tmp_path / "calc.jsonl", "offpolicy.actors.rollout.environments.calculator")
    )
    assert all(p.prompt_id.startswith("sum-") and p.answer.isdigit() for p in calc)
    for environment in (None, "offpolicy.actors.rollout.environments.guessing_game"):
        toy = load_prompts(toy_dataset(tmp_path / f"{environment}.jsonl", environment))
        assert all(p.prompt_id.startswith("toy-") and p.answer == "a" for p in toy)
