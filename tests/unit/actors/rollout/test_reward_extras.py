"""A verl reward's extra figures (`{"score": 1.0, "acc": True, "pred": "72"}`) become metrics per
`data_source`, as verl logs them: on each group (metadata `reward_extra/acc`), in the learner's step line
(`reward/<source>/mean`, `reward/<source>/acc`), and in an evaluation (`eval/<source>/reward_mean`,
`.../pass@1`, `.../acc`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from offpolicy.actors.config import ActorConfig, RewardConfig
from offpolicy.actors.data.evaluation import Evaluator
from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.rollout.rewards import Score
from offpolicy.actors.rollout.scoring import Scorer
from offpolicy.actors.rollout.submit import stamp_group
from offpolicy.buffer.types import SamplingParams
from offpolicy.learner.tracking.step_log import by_source

SEEN: list[str] = []


def verl_reward(data_source, solution_str, ground_truth, extra_info=None):
    """verl's dict result: the score, a bool, a parsed answer's text (not a number: left out)."""
    right = solution_str.strip().endswith(ground_truth)
    return {"score": float(right), "acc": right, "pred": solution_str[-2:], "format": 0.5}


def prompt(source: str | None, answer: str = "72", i: int = 0) -> Prompt:
    metadata = {"extra_info": json.dumps({"index": i})} | ({} if source is None else {"data_source": source})
    return Prompt(index=i, prompt_id=f"p{i}", text="48 + 24?", answer=answer, metadata=metadata)


def scored(p: Prompt, completions: list[str]) -> list[float]:
    scorer = Scorer(RewardConfig(name=f"{__name__}.verl_reward"))
    try:
        return asyncio.run(scorer.score(p, completions))
    finally:
        scorer.close()


def group(p: Prompt, completions: list[str]):
    rewards = scored(p, completions)
    fake = [
        SimpleNamespace(
            token_ids=np.arange(2, dtype=np.int32), behavior_logprobs=np.zeros(2, np.float32), text=c,
            finish_reason="stop", versions=None, policy_mask=None, num_experts=None,
        )
        for c in completions
    ]  # fmt: skip
    return stamp_group(p, np.arange(3, dtype=np.int32), fake, rewards, 0, "a0", SamplingParams())


def test_the_extra_figures_ride_with_the_score_and_land_on_the_group():
    rewards = scored(prompt("openai/gsm8k"), ["so 72", "so 70", "72"])
    assert rewards == [1.0, 0.0, 1.0] and all(isinstance(r, Score) for r in rewards)
    assert rewards[0].extra == {"acc": 1.0, "format": 0.5}  # the text `pred` is no figure
    g = group(prompt("openai/gsm8k"), ["so 72", "so 70", "72"])
    assert g.metadata["reward_extra/acc"] == repr(2 / 3) and g.metadata["reward_extra/format"] == "0.5"
    assert [type(t.reward) for t in g.trajectories] == [float] * 3


def test_the_step_line_has_the_reward_per_data_source_with_the_figures():
    groups = [
        group(prompt("openai/gsm8k", i=0), ["72", "70"]),
        group(prompt("openai/gsm8k", i=1), ["72", "72"]),
        group(prompt("lighteval/MATH", "5", i=2), ["4", "4"]),
        group(prompt(None, i=3), ["72", "1"]),
    ]
    out = by_source(groups)
    assert out["reward/openai/gsm8k/mean"] == 0.75 and out["reward/openai/gsm8k/acc"] == 0.75
    assert out["reward/lighteval/MATH/mean"] == 0.0 and out["reward/lighteval/MATH/acc"] == 0.0
    assert out["reward/all/mean"] == pytest.approx(4 / 8) and out["reward/all/format"] == 0.5
    assert "reward/None/mean" not in out


def test_a_figure_that_is_not_a_number_is_left_out_and_plain_groups_add_nothing():
    g = group(prompt("openai/gsm8k"), ["72"])
    g.metadata["reward_extra/acc"] = "not a number"  # a group posted over HTTP carries any text
    g.metadata["reward_extra/nan"] = "nan"
    out = by_source([g])
    assert out["reward/openai/gsm8k/mean"] == 1.0
    assert "reward/openai/gsm8k/acc" not in out and "reward/openai/gsm8k/nan" not in out
    plain = group(prompt(None), ["72"])
    for key in [k for k in plain.metadata if k.startswith("reward_extra/")]:
        del plain.metadata[key]
    assert by_source([plain]) == {}  # reward_mean already says it


class Tokenizer:
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 64 for c in text]}


class Engine:
    """Answers each held-out prompt with its answer but for the MATH ones (one of two samples right)."""

    tokenizer = Tokenizer()

    def sampling_params(self, sampling: Any, **overrides: Any) -> Any:
        return SimpleNamespace(n=overrides.get("n", sampling.n))

    async def generate_group(self, request_id: str, ids: list[int], params: Any) -> list[Any]:
        math = request_id.endswith(("-2", "-3"))
        texts = ["4", "5"] if math else ["72", "72"]
        return [SimpleNamespace(text=t, versions=None) for t in texts[: params.n]]


def test_an_evaluation_has_each_data_sources_reward_pass_and_figures(tmp_path: Path):
    data = tmp_path / "test.jsonl"
    rows = [
        {"prompt": "q", "answer": "72", "data_source": "openai/gsm8k"},
        {"prompt": "q", "answer": "72", "data_source": "openai/gsm8k"},
        {"prompt": "q", "answer": "5", "data_source": "lighteval/MATH"},
        {"prompt": "q", "answer": "5", "data_source": "lighteval/MATH"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = {"path": str(data), "metadata_keys": ["data_source"], "chat_template": False, "shuffle": False}
    config = ActorConfig.model_validate({
        "model_path": "m", "dataset": dataset,
        "reward": {"name": f"{__name__}.verl_reward", "signature": "verl"},
        "eval": {"dataset": dataset, "samples_per_prompt": 2, "every_versions": 1},
    })  # fmt: skip
    evaluator = Evaluator(config, Engine())
    try:
        record = asyncio.run(evaluator.run(0))
    finally:
        evaluator.close()
    m = record.metrics()
    assert m["eval/reward_mean"] == 0.75 and m["eval/extra/acc"] == 0.75
    assert m["eval/openai/gsm8k/reward_mean"] == 1.0 and m["eval/openai/gsm8k/pass@1"] == 1.0
    assert m["eval/lighteval/MATH/reward_mean"] == 0.5 and m["eval/lighteval/MATH/acc"] == 0.5
    assert m["eval/lighteval/MATH/pass@1"] == 0.5 and m["eval/lighteval/MATH/pass@2"] == 1.0
    assert m["eval/openai/gsm8k/prompts"] == 2.0
