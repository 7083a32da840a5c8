"""A prompt's episodes in `PromptGeneration` (hermetic: a stand-in engine): an environment's sampling
overrides (`stop`) reach the engine's sampling parameters, and an environment that raises anything sets its
group aside, counted, without ending the actor; only the engine's own death is the actor's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import DatasetConfig, RewardConfig, SamplingConfig
from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.errors import EngineError, PromptFailed
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.generation import PromptGeneration
from offpolicy.actors.rollout.scoring import RewardFailures, Scorer
from offpolicy.learner.model import build_char_tokenizer


class StandInEngine:
    """Records the sampling parameters each request asked for; every request fails as the engine would."""

    def __init__(self) -> None:
        self.tokenizer = build_char_tokenizer()
        self.asked: list[dict] = []

    def sampling_params(self, sampling, n=None, **overrides):
        self.asked.append({"n": n, **overrides})
        return overrides

    async def generate_group(self, request_id, tokens, params):
        raise PromptFailed(f"{request_id}: no engine here")


def generation_with(environment) -> tuple[PromptGeneration, StandInEngine, CollectorRegistry, list]:
    """A `PromptGeneration` built as the actor builds it, with a stand-in engine and a list as its pusher."""
    registry = CollectorRegistry()
    submitted: list = []
    metrics = ActorMetrics(registry)
    engine = StandInEngine()
    generation = PromptGeneration(
        engine,  # type: ignore[arg-type]
        metrics,
        Scorer(RewardConfig()),
        RewardFailures(metrics),
        environment,
        "a0",
        DatasetConfig(path="/d.jsonl"),
        max_model_len=64,
        submit=submitted.append,
        wake=lambda: None,
        on_error=lambda error: None,
    )
    return generation, engine, registry, submitted


def run(generation: PromptGeneration) -> None:
    sampling = SamplingConfig(n=2, max_tokens=16)
    asyncio.run(generation._run_episodes(Prompt(0, "p0", "hi"), np.array([5, 6]), 3, 0.0, sampling))


def failures(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("offpolicy_actor_reward_failures_total", {"reason": reason}) or 0.0


def test_an_episodes_stop_reaches_the_sampling_parameters():
    async def with_stop(ep):
        await ep.generate(stop=["\n"])
        return 1.0

    generation, engine, _, submitted = generation_with(with_stop)
    run(generation)  # each request fails in the stand-in engine: the prompt is skipped, nothing submitted
    assert engine.asked and all(a["stop"] == ["\n"] and a["max_tokens"] == 16 for a in engine.asked)
    assert submitted == []


@pytest.mark.parametrize("error", [RuntimeError("bug"), KeyError("x"), TypeError("bad call")])
def test_an_environment_that_raises_drops_its_group_and_the_actor_goes_on(error):
    async def broken(ep):
        raise error

    generation, _, registry, submitted = generation_with(broken)
    run(generation)
    assert submitted == [] and failures(registry, "environment") == 1.0


def test_the_engines_death_is_the_actors():
    async def dead_engine(ep):
        raise EngineError("vLLM's engine is dead")

    generation, _, registry, _ = generation_with(dead_engine)
    with pytest.raises(EngineError):
        run(generation)
    assert failures(registry, "environment") == 0.0
