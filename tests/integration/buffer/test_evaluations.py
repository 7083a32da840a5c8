"""Evaluation records: pass@k, the run's evaluation stream in Redis (what an evaluating actor appends and
the learner reads after the newest it saw), and the learner's step line carrying the newest evaluation."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from offpolicy.buffer.evaluations import AsyncEvalStore, EvalRecord, EvalStore, pass_at_k

pytestmark = pytest.mark.redis


def record(version: int, reward: float) -> EvalRecord:
    return EvalRecord(version, reward, {"1": reward / 2, "4": reward}, 16, 4, 0.5, "actor-0", time.time())


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_the_stream_hands_out_records_after_the_newest_seen(redis_url: str, run_id: str):
    store = EvalStore(redis_url, run_id)
    assert store.latest_id() == "0" and store.after("0") == []
    first = store.add(record(0, 0.1))
    assert store.latest_id() == first

    async def append() -> None:
        writer = AsyncEvalStore(redis_url, run_id)
        await writer.add(record(5, 0.4))
        await writer.add(record(10, 0.7))
        await writer.close()

    asyncio.run(append())
    new = store.after(first)
    assert [r.policy_version for _, r in new] == [5, 10]
    assert store.after(new[-1][0]) == []
    assert new[-1][1].metrics()["eval/reward_mean"] == 0.7 and new[-1][1].metrics()["eval/pass@4"] == 0.7
    assert [r.policy_version for _, r in store.after("0")] == [0, 5, 10]
    with pytest.raises(ValueError):  # never NaN on the wire
        EvalRecord(1, float("nan"), {}, 0, 1, 0.0, "a", 0.0).encode()
    store.close()
