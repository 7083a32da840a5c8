"""Reward failures counted by reason (`offpolicy_actor_reward_failures_total{reason}`), one ERROR when most
groups fail, both in the actor's status; a dataset whose answers math_answer cannot read, scored through
the gateway."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import RewardConfig
from offpolicy.actors.gateway.agent_episodes import Gateway
from offpolicy.actors.metrics import REWARD_FAILURE_REASONS, ActorMetrics
from offpolicy.actors.rollout.actor import Actor
from offpolicy.actors.rollout.scoring import ALARM_AFTER_GROUPS, RewardFailures, Scorer
from offpolicy.learner.model import build_char_tokenizer
from offpolicy.services.actor_api.schemas import ActorStatus
from tests.unit.actors.gateway.test_agent_episodes import ScriptedEngine, StubActor, run


def _count(registry: CollectorRegistry, name: str, reason: str) -> float | None:
    return registry.get_sample_value(f"offpolicy_actor_{name}_total", {"reason": reason})


def test_failures_by_reason_and_one_error_when_most_groups_fail(caplog):
    registry = CollectorRegistry()
    tally = RewardFailures(ActorMetrics(registry))
    assert all(_count(registry, "reward_failures", r) == 0 for r in REWARD_FAILURE_REASONS)
    for _ in range(8):
        tally.scored()
    for _ in range(ALARM_AFTER_GROUPS - 9):  # 19 groups, 11 failed: too few groups to judge
        tally.failed("bad_answer")
    assert tally.alarm() is None
    with caplog.at_level(logging.WARNING, logger="offpolicy.actors.rollout.scoring"):
        tally.failed("timeout")  # 20 groups, 12 failed
        for _ in range(10):
            tally.failed("bad_answer")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # once, not once per group
    assert "rewards failed for 12 of 20 groups; most often 'bad_answer' (11 groups)" in errors[0].message
    assert _count(registry, "reward_failures", "bad_answer") == 21
    assert _count(registry, "reward_failures", "timeout") == 1
    assert _count(registry, "failures", "reward_error") == 22
    status = tally.status()
    assert status["reward_failures"] == {"bad_answer": 21, "timeout": 1}
    assert "22 of 30 groups; most often 'bad_answer' (21 groups)" in status["reward_failure_alarm"]
    assert registry.get_sample_value("offpolicy_actor_reward_failure_alarm") == 1.0  # the alert's gauge
    for _ in range(15):
        tally.scored()  # 22 of 45: no longer most
    assert tally.status()["reward_failure_alarm"] is None
    assert registry.get_sample_value("offpolicy_actor_reward_failure_alarm") == 0.0
    with pytest.raises(ValueError, match="unknown reward failure reason"):
        tally.failed("whatever")  # labels stay bounded


def test_unreadable_answers_from_the_data_are_counted_as_bad_answer():
    """Episodes scored by math_answer against a reference that is prose: each group fails `bad_answer`,
    the loop goes on, and the actor's status (the real `Actor.status`) says why."""
    actor = StubActor(["\\boxed{5}"] * 3, group_size=1)
    actor.config = actor.config.model_copy(update={"reward": RewardConfig(name="math_answer")})
    actor.scorer = Scorer(actor.config.reward)
    gw = Gateway(actor)
    chat = {"model": "offpolicy", "messages": [{"role": "user", "content": "2+3?"}]}

    async def go() -> None:
        for answer in ("see the solution", "see the solution", "5"):
            eid = (await gw.open_episode("p", answer=answer))["episode_id"]
            await gw.chat(eid, chat)
            await gw.finish(eid)

    run(go())
    assert len(actor.pushed) == 1  # the readable one
    assert actor.metrics.reward_failures.labels("bad_answer")._value.get() == 2
    assert actor.reward_failures.status() == {
        "reward_failures": {"bad_answer": 2},
        "reward_failure_alarm": None,
    }

    real = Actor(actor.config, CollectorRegistry(), engine=ScriptedEngine(build_char_tokenizer(), []))
    real.reward_failures.failed("no_answer")
    status = ActorStatus(**real.status())
    assert (status.reward_failures, status.reward_failure_alarm) == ({"no_answer": 1}, None)
    real.close()
