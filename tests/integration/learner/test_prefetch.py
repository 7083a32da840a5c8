"""`prefetch`: the next step's groups are leased in the background while a step trains, at the version that
step will train at, and used by it; a config change gives them back, `close` gives them back, the last
step (`max_steps`) takes none, and a lease ahead that found no data leaves the step to lease itself. The
real learner on the embedded Redis."""

from __future__ import annotations

import threading
import time

import pytest

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import behaviour, config, make_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def groups(behaviour):  # noqa: F811
    return make_groups(behaviour, 8, version=0, temperature=0.9, seed=5)


def start(tiny_dir, redis_url, tmp_path, groups, **kw) -> Learner:  # noqa: F811
    kw = {"prefetch": True, "checkpoint": {"checkpoint_dir": None}} | kw
    cfg = config(tiny_dir, redis_url, tmp_path, **kw)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    return Learner(cfg)


def outstanding(learner: Learner) -> list[str]:
    return learner.buffer.leases(learner.delivery.consumer)


def test_the_next_steps_groups_are_leased_while_a_step_trains(tiny_dir, redis_url, tmp_path, groups):  # noqa: F811
    learner = start(tiny_dir, redis_url, tmp_path, groups)
    try:
        learner.step()  # trains 2 groups (acked: delivery step) and leases the next 2 ahead
        ahead = outstanding(learner)
        assert len(ahead) == 2 and learner.intake.prefetched == 0
        learner.step()  # trains exactly those: they are acked, 2 more are leased ahead
        assert learner.intake.prefetched == 1 and not set(ahead) & set(outstanding(learner))
        assert len(outstanding(learner)) == 2 and learner.version == 2
    finally:
        learner.close()
    off = start(tiny_dir, redis_url, tmp_path / "off", groups, prefetch=False)
    try:
        off.step()
        assert outstanding(off) == [] and off.intake.prefetched == 0
    finally:
        off.close()


def test_the_version_ahead_counts_every_optimizer_step(tiny_dir, redis_url, tmp_path, groups):  # noqa: F811
    """2 PPO epochs x 2 mini-batches: the step makes 4 versions, and the lease ahead was for that one."""
    learner = start(tiny_dir, redis_url, tmp_path, groups, ppo_epochs=2, mini_batch_groups=1)
    try:
        learner.step()
        learner.step()
        assert learner.version == 8 and learner.intake.prefetched == 1
    finally:
        learner.close()


def test_a_config_change_gives_the_lease_ahead_back(tiny_dir, redis_url, tmp_path, groups):  # noqa: F811
    learner = start(tiny_dir, redis_url, tmp_path, groups)
    try:
        learner.step()
        ahead = outstanding(learner)
        assert len(ahead) == 2
        learner.apply_config(learner.config.model_copy(update={"groups_per_step": 1}), config_version=1)
        result = learner.step()  # leased anew under the new config: one group; the two given back
        assert result["groups"] == 1.0 and learner.intake.prefetched == 0
        assert not set(ahead) & set(outstanding(learner))  # released, not trained
        assert learner.buffer.stats().size == 8 - 2 - 1  # consumed: step 1's two, step 2's one
    finally:
        learner.close()


def test_close_gives_back_what_was_leased_ahead(tiny_dir, redis_url, tmp_path, groups):  # noqa: F811
    learner = start(tiny_dir, redis_url, tmp_path, groups)
    consumer, run_id = learner.delivery.consumer, learner.config.run_id
    try:
        learner.step()
        assert len(outstanding(learner)) == 2
    finally:
        learner.close()
    with ReplayBuffer(redis_url, run_id, learner.config.buffer) as buf:
        assert buf.leases(consumer) == [] and buf.stats().size == 6  # nothing lost with the lease ahead


def test_the_last_step_leases_nothing_ahead(tiny_dir, redis_url, tmp_path, groups):  # noqa: F811
    learner = start(tiny_dir, redis_url, tmp_path, groups, max_steps=2)
    try:
        learner.step()
        assert len(outstanding(learner)) == 2
        learner.step()  # the last: nothing leased ahead
        assert outstanding(learner) == [] and learner.intake.prefetched == 1
    finally:
        learner.close()


def test_a_lease_ahead_that_found_no_data_leaves_the_step_to_lease(tiny_dir, redis_url, tmp_path, groups):  # noqa: F811
    """Only one step's groups: the lease ahead gives up (no data within its 2 s); groups inserted later are
    leased by the next step itself, which waits for them as without `prefetch`."""
    learner = start(tiny_dir, redis_url, tmp_path, groups[:2], sample_timeout_s=10.0)
    try:
        learner.step()
        timer = threading.Timer(3.0, lambda: insert(redis_url, learner, groups[2:4]))
        timer.start()
        began = time.monotonic()
        result = learner.step()
        timer.join()
        assert result["groups"] == 2.0 and learner.intake.prefetched == 0
        assert time.monotonic() - began >= 2.5  # it waited for the late groups
    finally:
        learner.close()


def insert(redis_url: str, learner: Learner, groups: list) -> None:
    with ReplayBuffer(redis_url, learner.config.run_id, learner.config.buffer) as buf:
        buf.insert_many(groups)
