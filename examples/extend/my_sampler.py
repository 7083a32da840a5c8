"""A sampling rule of your own, without editing the buffer: as a group's `priority` under the built-in
`prioritized` sampler (docs/extend.md "A buffer sampler").

The buffer's samplers are Lua inside Redis (`offpolicy/buffer/scripts/samplers.lua`: one atomic script
chooses and leases the groups); there is no Python hook, and `buffer.sampler` accepts only the five built-in
names. What you can set without editing the package is the weight of each group: with `buffer.sampler:
prioritized` the learner draws groups without replacement with probability proportional to `priority +
priority_epsilon`. A producer that builds its own groups sets `TrajectoryGroup.priority` (or `"priority"`
in a `POST /v1/groups` document); a group without one gets the mean |reward - group mean| (the |advantage|
proxy, `offpolicy.buffer.samplers.group_priority`). The actor's own groups carry none.

Here: "learnability", 4 p (1 - p) for a group whose completions pass with rate p: 1.0 at p = 0.5, 0.0 for
a group that all pass or all fail (no signal for a group-relative advantage). With `priority_epsilon: 0`
groups of priority 0 are drawn only when nothing else is left.

    python examples/extend/my_sampler.py    # an embedded redis-server, four groups, two draws
"""

from __future__ import annotations

import tempfile
import time
import uuid

import numpy as np

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup

PASS = 0.5  # a completion passes when its reward is at least this


def learnability(rewards: list[float]) -> float:
    """4 p (1 - p) of the pass rate p: the priority of a group with these rewards (0..1)."""
    p = float(np.mean([r >= PASS for r in rewards]))
    return 4.0 * p * (1.0 - p)


def make_group(prompt_id: str, rewards: list[float], policy_version: int = 0) -> TrajectoryGroup:
    """A group as a producer of your own builds it (token ids and behaviour log-probs from your engine),
    with its `priority` set."""
    rng = np.random.default_rng(len(prompt_id))
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex,
        prompt_id=prompt_id,
        prompt_ids=rng.integers(0, 100, 8, dtype=np.int32),
        policy_version=policy_version,
        actor_id="my-producer",
        created_at=time.time(),
        sampling=SamplingParams(temperature=1.0, max_tokens=16),
        trajectories=[
            Trajectory(
                response_ids=rng.integers(0, 100, 16, dtype=np.int32),
                behavior_logprobs=-rng.random(16, dtype=np.float32),
                reward=r,
                finish_reason="stop",
            )
            for r in rewards
        ],
        priority=learnability(rewards),
    )


def demo(redis_url: str, run_id: str) -> list[str]:
    """Insert four groups (pass rates 0, 1, 1/2, 1/4) and sample two: the prompt ids drawn, in order."""
    # the learner's `buffer` section decides the sampler (producers adopt its table-wide fields)
    config = BufferConfig(sampler="prioritized", priority_epsilon=0.0, max_times_sampled=1)
    producer = ReplayBuffer(redis_url, run_id, config)
    learner = ReplayBuffer(redis_url, run_id, config, follow_learner=False)
    try:
        groups = [
            make_group("all-fail", [0.0, 0.0, 0.0, 0.0]),
            make_group("all-pass", [1.0, 1.0, 1.0, 1.0]),
            make_group("half", [1.0, 0.0, 1.0, 0.0]),
            make_group("quarter", [1.0, 0.0, 0.0, 0.0]),
        ]
        result = producer.insert_many(groups)
        assert result.ok, result.rejected
        return [g.prompt_id for g in learner.sample(2, consumer_version=0, timeout_s=5.0)]
    finally:
        learner.clear()
        producer.close()
        learner.close()


if __name__ == "__main__":
    from offpolicy.buffer.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory() as folder, EmbeddedRedis.start(folder) as redis:
        print("sampled", sorted(demo(redis.url, "my-sampler-demo")))
