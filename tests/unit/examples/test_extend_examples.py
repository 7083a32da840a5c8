"""docs/extend.md's examples (examples/extend/) run, each through the extension point it documents: a
reward and an environment by dotted path with their folder on the path (as a deployment's PYTHONPATH puts
it), a sampling rule as priorities under the `prioritized` sampler on a real Redis, a tracker sink under the
learner's `Tracker`, a transfer engine pair in vLLM's factories. Where the page says an extension needs an
edit of the package (a sampler's or a backend's name, a sink in `tracking:`), a test holds that true, so
the page cannot drift from the code."""

from __future__ import annotations

import asyncio
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

EXTEND = Path(__file__).resolve().parents[3] / "examples" / "extend"
EXAMPLES = ("my_reward", "my_environment", "my_sampler", "my_sink", "my_transfer")


@pytest.fixture(autouse=True)
def extend_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """examples/extend/ first on sys.path (what PYTHONPATH does for a deployment); its modules forgotten
    afterwards."""
    monkeypatch.syspath_prepend(str(EXTEND))
    yield
    for name in EXAMPLES:
        sys.modules.pop(name, None)


def run_script(name: str) -> None:
    """`python examples/extend/<name>` in this process: its folder on the path, run as `__main__`."""
    runpy.run_path(str(EXTEND / name), run_name="__main__")


# --- a reward


def test_the_rewards_score_through_the_actors_scorer(capsys: pytest.CaptureFixture[str]):
    from my_reward import demo

    assert demo() == {
        "my_reward.last_line_number": [1.0, 0.0, 0.0],
        "my_reward.closest_first": [1.0, 0.5, 0.0],
    }
    run_script("my_reward.py")
    assert "my_reward.closest_first [1.0, 0.5, 0.0]" in capsys.readouterr().out


def test_a_reward_without_an_answer_is_a_counted_data_failure_and_a_typo_fails_at_start():
    from my_reward import last_line_number

    from offpolicy.actors.config import RewardConfig
    from offpolicy.actors.data.prompts import Prompt
    from offpolicy.actors.errors import RewardError
    from offpolicy.actors.rollout.rewards import resolve_reward
    from offpolicy.actors.rollout.scoring import Scorer

    assert resolve_reward("my_reward.last_line_number") is last_line_number
    with pytest.raises(ValueError, match="cannot import 'nope' from 'my_reward'"):
        resolve_reward("my_reward.nope")
    scorer = Scorer(RewardConfig(name="my_reward.last_line_number"))
    try:
        with pytest.raises(RewardError) as failed:
            asyncio.run(scorer.score(Prompt(0, "p", "no answer here"), ["42"]))
    finally:
        scorer.close()
    assert failed.value.reason == "no_answer"


# --- an environment


def test_the_environment_records_policy_turns_and_masks_its_own(capsys: pytest.CaptureFixture[str]):
    from my_environment import demo

    result, completion = demo(["aaa"])  # a first-turn hit: one policy turn, nothing masked
    assert result.reward == 1.0 and result.metadata == {"tries": "1"} and completion.policy_mask is None
    result, completion = demo(["bbb", "xax"])  # a miss, the user's reply, a hit
    assert result.reward == 0.5 and result.metadata == {"tries": "2"}
    mask = completion.policy_mask.tolist()
    assert mask[:3] == [True] * 3 and mask[-3:] == [True] * 3 and not any(mask[3:-3])
    assert completion.text == "bbbxax"  # the policy's text; the user's turn is in the tokens only
    behavior_logprobs = completion.behavior_logprobs
    assert (behavior_logprobs[3:-3] == 0).all() and (behavior_logprobs[:3] == -0.5).all()
    run_script("my_environment.py")
    assert "reward 0.5 {'tries': '2'}" in capsys.readouterr().out


# --- a buffer sampler


@pytest.mark.redis
def test_priorities_under_the_prioritized_sampler_draw_the_learnable_groups(redis_url: str, run_id: str):
    from my_sampler import demo, learnability

    assert learnability([1, 0, 1, 0]) == 1.0 and learnability([1, 0, 0, 0]) == 0.75
    assert learnability([0, 0]) == 0.0 and learnability([1, 1]) == 0.0
    for attempt in range(5):  # priority 0 with priority_epsilon 0: never drawn while others are left
        assert sorted(demo(redis_url, f"{run_id}-{attempt}")) == ["half", "quarter"]


@pytest.mark.redis
def test_the_sampler_script_runs_on_an_embedded_redis(capsys: pytest.CaptureFixture[str]):
    run_script("my_sampler.py")
    assert "sampled ['half', 'quarter']" in capsys.readouterr().out


def test_a_new_sampler_name_needs_an_edit_of_the_buffer():
    from offpolicy.buffer.config import BufferConfig

    assert BufferConfig(sampler="prioritized").sampler == "prioritized"
    with pytest.raises(ValidationError, match="sampler"):
        BufferConfig(sampler="learnability")


# --- a tracker sink


def test_the_sink_runs_under_the_learners_tracker(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from my_sink import COLUMNS, demo

    rows, failures = demo(tmp_path)
    assert [r["step"] for r in rows] == ["1", "2", "3"] and list(rows[0]) == list(COLUMNS)
    assert [float(r["reward_mean"]) for r in rows] == [0.25, 0.5, 0.75]
    assert rows[0]["grad_norm"] == ""  # NaN is left out, as TensorBoard's and W&B's sinks leave it
    assert failures == 3.0  # the broken sink: every step counted, none stopped
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # the JSONL sink beside it
    run_script("my_sink.py")
    assert "broken sink failures counted: 3.0" in capsys.readouterr().out


def test_a_sink_in_the_learner_service_needs_an_edit_of_the_tracking_section():
    from offpolicy.learner.config.tracking import TrackingConfig

    with pytest.raises(ValidationError, match="csv_path"):
        TrackingConfig(csv_path="runs/steps.csv")


# --- a transfer backend


def test_the_engine_pair_registers_in_vllms_factories(capsys: pytest.CaptureFixture[str]):
    from my_transfer import BACKEND, MyTrainerWeightTransferEngine, MyWeightTransferEngine, demo
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    try:
        worker, trainer, verdict = demo()
        assert worker is MyWeightTransferEngine and trainer is MyTrainerWeightTransferEngine
        # the package accepts only the backends it lists: docs/extend.md's edits are still needed
        assert verdict.startswith("refused") and "'gloo_m2n'" in verdict
        run_script("my_transfer.py")
        out = capsys.readouterr().out
        assert "worker MyWeightTransferEngine, trainer MyTrainerWeightTransferEngine" in out
    finally:  # vLLM's factories are process-wide: leave them as this test found them
        WeightTransferEngineFactory._registry.pop(BACKEND, None)
        WeightTransferTrainerFactory._registry.pop(BACKEND, None)
