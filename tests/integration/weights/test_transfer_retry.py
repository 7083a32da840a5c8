"""A send broken by a member's death, on real Redis and the real gloo trainer engine, without vLLM engines:
the members are fakes that beat and answer the learner's commands (0 workers each: the learner is the
group's only rank, so the broadcast needs no peer). The broadcast breaks on its last bucket after the
survivor confirmed the version (a peer died there); the learner finds the dead one within its lapse and
sends again only to the survivors that did not confirm it: one that confirmed is not sent the version
twice, one whose receive failed is."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from offpolicy.learner.transport.vllm import VllmTransport
from offpolicy.weights.config import TransferConfig
from offpolicy.weights.control import ActorControl, LearnerControl

pytestmark = pytest.mark.redis

CFG = TransferConfig(backend="gloo", timeout_s=10.0, heartbeat_s=1.0, bucket_bytes=1 << 20)
WEIGHTS = {f"w{i}": torch.full((192, 1024), float(i)) for i in range(4)}  # 768 KiB each: 2 buckets of 2
TENSOR_BYTES = 192 * 1024 * 4


class Fake:
    """A member that beats every heartbeat and answers `init` ok; `update`: ok (`answer="ok"`), an error
    (`"error"`: its receive failed), or never, its heartbeats stopping as it takes it (`"die"`).
    `updates` counts the update commands it took, by version."""

    def __init__(self, redis_url: str, run_id: str, actor_id: str, answer: str) -> None:
        self.redis_url, self.run_id, self.actor_id, self.answer = redis_url, run_id, actor_id, answer
        self.updates: dict[int, int] = {}
        self.answered = threading.Event()  # it answered an update

    async def run(self, stop: threading.Event) -> None:
        c = ActorControl(self.redis_url, self.run_id, self.actor_id)
        try:
            while not stop.is_set():
                await c.heartbeat(0, 0, 3 * CFG.heartbeat_s)
                cmd = await c.next_command(CFG.heartbeat_s / 5)
                if cmd is None or cmd["op"] == "leave":
                    continue
                if cmd["op"] == "update":
                    version = int(cmd["version"])
                    self.updates[version] = self.updates.get(version, 0) + 1
                    if self.answer == "die":
                        return  # no answer, no more beats
                    ok = self.answer == "ok" or self.updates[version] > 1  # a resend is received well
                    await c.answer(cmd["token"], ok, "" if ok else "the receive failed")
                    self.answered.set()
                else:
                    await c.answer(cmd["token"], True)
        finally:
            await c.close()


@contextmanager
def running(*fakes: Fake):
    stop = threading.Event()
    threads = [threading.Thread(target=asyncio.run, args=(f.run(stop),), daemon=True) for f in fakes]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(10)


class BreaksOnLastBucket:
    """The learner's weights; on the second version's data pass, the last tensor (in the last bucket) raises
    once `survivor` answered the update: the broadcast breaks on its last bucket."""

    def __init__(self, survivor: Fake) -> None:
        self.survivor, self.calls = survivor, 0

    def __call__(self):
        outer = self

        class State(dict):
            def items(self) -> Iterator:
                outer.calls += 1  # each send reads the metadata, then iterates the weights
                for i, pair in enumerate(dict.items(self)):
                    if outer.calls == 4 and i == len(self) - 1:
                        assert outer.survivor.answered.wait(10), "the survivor never answered"
                        raise RuntimeError("the broadcast to a dead peer breaks on the last bucket")
                    yield pair

        return State(WEIGHTS)


def _wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("survivor_answer", ["ok", "error"])
def test_a_broken_send_is_made_again_only_to_survivors_without_the_version(
    redis_url, run_id, survivor_answer
):
    control = LearnerControl(redis_url, run_id)
    a, b = Fake(redis_url, run_id, "a", "ok"), Fake(redis_url, run_id, "b", "ok")
    transport = VllmTransport(CFG, control, BreaksOnLastBucket(a), torch.float32)
    try:
        with running(a, b):
            _wait_for(lambda: [m.actor_id for m in control.members()] == ["a", "b"], "a and b to announce")
            first = transport.send(1)
            assert first.ok and first.group_size == 2, first
            a.answer, b.answer = survivor_answer, "die"
            a.answered.clear()
            result = transport.send(2)
        assert result.ok and result.group_size == 1 and result.dropped == ("b",), result
        assert b.updates == {1: 1, 2: 1}
        if survivor_answer == "ok":  # it confirmed v2 before the broadcast broke: not sent it again
            assert a.updates == {1: 1, 2: 1}, a.updates
            assert result.bytes == 2 * TENSOR_BYTES, result.bytes  # the bucket before the break, no resend
        else:  # its receive failed: v2 is sent to it again, every bucket
            assert a.updates == {1: 1, 2: 2}, a.updates
            assert result.bytes == 6 * TENSOR_BYTES, result.bytes
        # what b's death cost: its lapse (1.25 x heartbeat_s) and the reads, within 2 x heartbeat_s
        bound = 2 * CFG.heartbeat_s
        assert result.dead_wait_s <= bound, (
            f"the dead member cost {result.dead_wait_s:.3f} s, over 2 x heartbeat_s = {bound:g} s"
        )
        print(f"survivor {survivor_answer}: dead member cost {result.dead_wait_s:.3f} s (bound {bound:g} s)")
    finally:
        transport.close()


class HangsOnShutdown:
    """A transfer engine whose `shutdown` hangs (NCCL's synchronizes the device behind a collective that
    never completes) until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def shutdown(self) -> None:
        self.release.wait(60)


def test_a_teardown_that_hangs_costs_its_bound_once_and_sends_fail_at_once_until_it_ends(
    redis_url: str, run_id: str
) -> None:
    """The training thread waits for a group's teardown at most 0.6 x timeout_s; past it the teardown is
    counted stuck and ends in the background, and every send fails at once meanwhile (no stacking)."""
    cfg = CFG.model_copy(update={"timeout_s": 2.0})
    transport = VllmTransport(cfg, LearnerControl(redis_url, run_id), lambda: WEIGHTS, torch.float32)
    hung = HangsOnShutdown()
    try:
        transport.engine = hung
        t0 = time.monotonic()
        transport._teardown()  # what a failed send does on the training thread
        took = time.monotonic() - t0
        assert 0.6 * cfg.timeout_s <= took < 0.6 * cfg.timeout_s + 1.0, took
        assert (transport.stuck, transport.busy, transport.engine) == (1, True, None)
        t0 = time.monotonic()
        result = transport.send(1)
        assert not result.ok and "still unwinding" in result.error and time.monotonic() - t0 < 0.5
        hung.release.set()
        transport._closing.join(5)
        assert not transport.busy and transport.stuck == 1
    finally:
        hung.release.set()
        transport.close()
