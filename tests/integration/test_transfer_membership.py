"""The transfer group's membership and bounds on real Redis, without engines: heartbeats expire, a member
that never answers makes the send fail within `timeout_s` and sits out the next send, a restarted member
(a new incarnation) comes back at once, and a send with no members is a no-op."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from offpolicy.learner.transport.vllm import VllmTransport
from offpolicy.weights.config import TransferConfig
from offpolicy.weights.control import ActorControl, LearnerControl

pytestmark = pytest.mark.redis

CFG = TransferConfig(backend="gloo", timeout_s=5.0, heartbeat_s=0.2)


def _beat(redis_url: str, run_id: str, actor_id: str, ttl_s: float, control: ActorControl | None = None):
    async def go():
        c = control or ActorControl(redis_url, run_id, actor_id)
        await c.heartbeat(1, 0, ttl_s)
        if control is None:
            await c.close()

    asyncio.run(go())


def test_membership_expires_with_the_heartbeat(redis_url, run_id):
    control = LearnerControl(redis_url, run_id)
    try:
        _beat(redis_url, run_id, "a", 0.5)
        _beat(redis_url, run_id, "b", 5.0)
        assert [m.actor_id for m in control.members()] == ["a", "b"]
        time.sleep(0.8)
        assert [m.actor_id for m in control.members()] == ["b"]
    finally:
        control.close()


def test_a_silent_member_fails_the_send_within_its_bound_then_sits_out(redis_url, run_id):
    control = LearnerControl(redis_url, run_id)
    weights = {"w": torch.ones(4, 4)}
    transport = VllmTransport(CFG, control, lambda: weights, torch.float32)
    try:
        assert transport.send(1).ok and transport.send(1).group_size == 0  # nobody yet: nothing to do
        _beat(redis_url, run_id, "silent", 30.0)  # announced, never executes a command
        t0 = time.monotonic()
        failed = transport.send(2)
        took = time.monotonic() - t0
        assert not failed.ok and failed.group_size == 1 and "silent" in failed.error
        assert took < CFG.timeout_s + 1.0, took
        assert not transport.busy or time.sleep(CFG.timeout_s) is None
        skipped = transport.send(3)  # benched for one send
        assert skipped.ok and skipped.group_size == 0
        again = transport.send(4)  # back in, still silent: fails again, now benched for two sends
        assert not again.ok and again.group_size == 1
        assert transport.send(5).group_size == 0 and transport.send(6).group_size == 0
        # a restart (new incarnation) comes back at once
        _beat(redis_url, run_id, "silent", 30.0)
        t0 = time.monotonic()
        assert transport.send(7).group_size == 1
        assert time.monotonic() - t0 < CFG.timeout_s + 1.0
    finally:
        transport.close()
