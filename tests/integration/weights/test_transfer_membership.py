"""The transfer group's membership and bounds on real Redis, without engines: heartbeats expire, a member
that beats but never answers makes the send fail within `timeout_s` and sits out the next send, a
restarted member (a new incarnation) comes back at once, and a send with no members is a no-op. A member
whose heartbeats stop is dead within its lapse (1.25 x `heartbeat_s`), whatever its record's TTL: never
admitted to a send, its answers not awaited (an update the others confirmed stands, the dead one dropped)."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from offpolicy.learner.transport.fanout import FanoutClient
from offpolicy.learner.transport.vllm import VllmTransport
from offpolicy.weights.config import TransferConfig
from offpolicy.weights.control import ActorControl, LearnerControl, Liveness

pytestmark = pytest.mark.redis

CFG = TransferConfig(backend="gloo", timeout_s=5.0, heartbeat_s=0.2)


def _beat(redis_url: str, run_id: str, actor_id: str, ttl_s: float, control: ActorControl | None = None):
    async def go():
        c = control or ActorControl(redis_url, run_id, actor_id)
        await c.heartbeat(1, 0, ttl_s)
        if control is None:
            await c.close()

    asyncio.run(go())


@contextmanager
def beating(redis_url: str, run_id: str, actor_id: str, answer: bool = False, ttl_s: float | None = None):
    """`actor_id` beats every heartbeat (alive) until the block ends (dead: its record stays `ttl_s`, 3
    beats unless told); with `answer`, it also takes every command and answers it ok."""
    stop = threading.Event()

    async def go():
        c = ActorControl(redis_url, run_id, actor_id)
        while not stop.is_set():
            await c.heartbeat(1, 0, ttl_s or 3 * CFG.heartbeat_s)
            if not answer:
                await asyncio.sleep(CFG.heartbeat_s)
            elif (cmd := await c.next_command(CFG.heartbeat_s)) is not None:
                await c.answer(cmd["token"], True)
        await c.close()

    t = threading.Thread(target=asyncio.run, args=(go(),), daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _ids(control: LearnerControl) -> list[str]:
    return [m.actor_id for m in control.members()]


def _wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_membership_expires_with_the_heartbeat(redis_url, run_id):
    control = LearnerControl(redis_url, run_id)
    try:
        t0 = time.monotonic()
        _beat(redis_url, run_id, "a", 0.5)
        _beat(redis_url, run_id, "b", 5.0)
        assert [m.actor_id for m in control.members()] == ["a", "b"]
        _wait_for(lambda: _ids(control) == ["b"], "a's record to expire (b's lives 5 s)", 4.0)
        assert time.monotonic() - t0 >= 0.5, "a's record expired before its TTL"
    finally:
        control.close()


def test_a_silent_member_fails_the_send_within_its_bound_then_sits_out(redis_url, run_id):
    control = LearnerControl(redis_url, run_id)
    weights = {"w": torch.ones(4, 4)}
    transport = VllmTransport(CFG, control, lambda: weights, torch.float32)
    try:
        assert transport.send(1).ok and transport.send(1).group_size == 0  # nobody yet: nothing to do
        with beating(redis_url, run_id, "silent"):  # alive, announced, never executes a command
            _wait_for(lambda: _ids(control) == ["silent"], "silent to announce itself")
            t0 = time.monotonic()
            failed = transport.send(2)
            took = time.monotonic() - t0
            assert took < CFG.timeout_s + 1.0, took
            # its waits end before the send's bound: the send ended, nothing is left unwinding
            assert not transport.busy, failed.error
            assert not failed.ok and failed.group_size == 1 and "silent" in failed.error
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


def test_a_member_whose_heartbeats_stop_is_never_admitted(redis_url, run_id):
    control = LearnerControl(redis_url, run_id)
    transport = VllmTransport(CFG, control, lambda: {"w": torch.ones(2)}, torch.float32)
    try:
        with beating(redis_url, run_id, "gone", ttl_s=30 * CFG.heartbeat_s):  # its record outlives its beats
            _wait_for(lambda: _ids(control) == ["gone"], "gone to announce itself")
            transport.liveness.observe(control.members())
        dead = transport.liveness.dead  # its count stopped moving: dead after the lapse
        _wait_for(lambda: dead(control.members(), ["gone"]) == {"gone"}, "gone's beats to lapse", 2.0)
        assert [m.actor_id for m in control.members()] == ["gone"]  # still announced
        t0 = time.monotonic()
        result = transport.send(1)
        assert result.ok and result.group_size == 0, result  # not admitted: no rendezvous waited for
        assert time.monotonic() - t0 < 1.0
    finally:
        transport.close()


def test_answers_are_not_awaited_from_the_dead(redis_url, run_id):
    """An update two members took: the live one answers, the other's heartbeats stopped; the wait ends
    within the lapse (timeout_s is 5 s) and the update stands, the dead member dropped."""
    control = LearnerControl(redis_url, run_id)
    liveness = Liveness(1.25 * CFG.heartbeat_s)
    try:
        with beating(redis_url, run_id, "live", answer=True):
            with beating(redis_url, run_id, "dead"):
                _wait_for(lambda: _ids(control) == ["dead", "live"], "both to announce themselves")
                members = control.members()
                liveness.observe(members)
            assert [m.actor_id for m in members] == ["dead", "live"]
            client = FanoutClient(control, members, epoch=1, timeout_s=CFG.timeout_s, liveness=liveness)
            client.version = 3
            t0 = time.monotonic()
            client.update_weights({"names": []})
            took = time.monotonic() - t0
        assert client.dropped == {"dead"}
        assert took < 1.25 * CFG.heartbeat_s + 1.0 < CFG.timeout_s, took
    finally:
        control.close()
