"""A verl reward module as verl users have it: `compute_score(data_source, solution_str, ground_truth,
extra_info)`, the signature of verl's `custom_reward_function`, run by the actor as it is
(docs/coming-from-verl.md).

Put this folder on the actor's PYTHONPATH (locally: `PYTHONPATH=examples/verl`) and name the function:

    dataset: {path: ~/data/gsm8k/train.parquet, preset: verl}   # data_source, extra_info into the metadata
    reward: {name: gsm8k_reward.compute_score}                    # signature verl: detected

The actor calls it with the record's `data_source`, the completion's text, `reward_model.ground_truth`
and the record's `extra_info` (a dict), on its reward threads, under `reward.timeout_s`; a number or
verl's `{"score": ...}` is the reward. The GSM8K scoring below is written for this example: the answer
after the completion's last `#### ` (strict, as GSM8K writes its solutions), or its last number
(flexible), against the ground truth, commas dropped.

    python examples/verl/gsm8k_reward.py     # scores three completions through the actor's Scorer
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

_STRICT = re.compile(r"#### *(-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9][0-9.,]*")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a completion: after its last `#### ` (`strict`), or its last number
    (`flexible`); commas and a trailing period dropped. None when there is none."""
    found = _STRICT.findall(solution_str) if method == "strict" else _NUMBER.findall(solution_str)
    if not found:
        return None
    answer = found[-1].replace(",", "").rstrip(".")
    return answer or None


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the completion's answer equals the ground truth, `format_score` when it states one that
    differs, 0.0 when it states none."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth.replace(",", "").strip() else format_score


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """verl's reward entry point: GSM8K's score for `openai/gsm8k` records; other data sources are not
    this module's (verl's `default_compute_score` raises the same way)."""
    if data_source != "openai/gsm8k":
        raise NotImplementedError(f"no reward for data_source {data_source!r}")
    return gsm8k_score(solution_str, ground_truth)


def demo() -> list[float]:
    """Three completions of one verl record scored through the actor's reward path."""
    from offpolicy.actors.config import RewardConfig
    from offpolicy.actors.data.prompts import Prompt
    from offpolicy.actors.rollout.scoring import Scorer

    meta = {"data_source": "openai/gsm8k", "extra_info": '{"split": "train", "index": 0}'}
    prompt = Prompt(0, "0", "How many clips?", "72", meta)
    scorer = Scorer(RewardConfig(name="gsm8k_reward.compute_score"))
    try:
        completions = ["48 + 24 = 72\n#### 72", "#### 70", "It is 72."]
        return asyncio.run(scorer.score(prompt, completions))
    finally:
        scorer.close()


if __name__ == "__main__":
    print("gsm8k_reward.compute_score", demo())
