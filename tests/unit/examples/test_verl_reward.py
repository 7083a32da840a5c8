"""A verl reward module as it is (examples/verl/gsm8k_reward.py: `compute_score(data_source, solution_str,
ground_truth, extra_info)`) scores verl's GSM8K parquet through the actor's reward path: the records read
with `preset: verl`, the signature detected from the function's parameters (or set), `extra_info` handed
over as the dict verl stores, verl's `{"score": ...}` results read."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from offpolicy.actors.config import DatasetConfig, RewardConfig
from offpolicy.actors.data.prompts import load_prompts
from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.scoring import Scorer
from tests.data.gsm8k import verl_rows

VERL = Path(__file__).resolve().parents[3] / "examples" / "verl"
SEEN: list[tuple[Any, ...]] = []


@pytest.fixture(autouse=True)
def verl_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(VERL))
    yield
    sys.modules.pop("gsm8k_reward", None)


def recording_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, untyped as verl's users write it; answers verl's dict form."""
    SEEN.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(ground_truth in solution_str), "acc": True}


def score(config: RewardConfig, prompt: Any, completions: list[str]) -> list[float]:
    scorer = Scorer(config)
    try:
        return asyncio.run(scorer.score(prompt, completions))
    finally:
        scorer.close()


def test_a_verl_compute_score_scores_verl_records_through_the_actor(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    first = load_prompts(DatasetConfig.model_validate({"path": str(path), "preset": "verl"}))[0]
    completions = ["48/2 = 24, 48 + 24 = 72\n#### 72", "#### 70", "The answer is 72."]
    detected = RewardConfig(name="gsm8k_reward.compute_score")
    assert detected.signature is None
    assert score(detected, first, completions) == [1.0, 0.0, 0.0]  # strict: after `####` only
    assert score(detected.model_copy(update={"signature": "verl"}), first, completions) == [1.0, 0.0, 0.0]
    from gsm8k_reward import demo, extract_answer

    assert demo() == [1.0, 0.0, 0.0]
    assert extract_answer("so 1,234.", "flexible") == "1234" and extract_answer("no number") is None


def test_the_arguments_are_verls_and_a_wrong_signature_fails_at_start(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    first = load_prompts(DatasetConfig.verl(str(path)))[0]
    SEEN.clear()
    name = f"{__name__}.recording_score"
    assert score(RewardConfig(name=name), first, ["#### 72"]) == [1.0]
    ((source, text, truth, extra),) = SEEN
    assert (source, text, truth) == ("openai/gsm8k", "#### 72", "72")
    assert extra["index"] == 0 and extra["split"] == "train"  # the dict verl stored, not its JSON
    with pytest.raises(ValueError, match="signature: verl"):
        Scorer(RewardConfig(name=name, signature="text"))
    other = first.__class__(0, "0", "q", "72", {"data_source": "other/set"})
    with pytest.raises(RewardError, match="NotImplementedError"):
        score(RewardConfig(name="gsm8k_reward.compute_score"), other, ["#### 72"])
