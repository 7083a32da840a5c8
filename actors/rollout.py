"""One batch's way into the buffer: score completions, stamp groups, wait for room, insert with retries.

Nothing generated is dropped while the actor runs: a Redis outage or a rate limiter that says no makes
the actor wait (each wait bounded by `RetryConfig`, counted in `offpolicy_actor_buffer_wait_seconds_total`)
and try again. Only a reward function that fails drops its group (counted as `reward_error`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from actors.errors import RewardError
from actors.rewards import RewardFn, score
from buffer.errors import RateLimited, StorageUnavailable
from buffer.types import SamplingParams, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import numpy as np

    from actors.config import RetryConfig, SamplingConfig
    from actors.engine import Completion
    from actors.metrics import ActorMetrics
    from actors.prompts import Prompt
    from buffer.replay_buffer import AsyncReplayBuffer

log = logging.getLogger(__name__)
_STOP_POLL_S = 0.1


def stamped_sampling(sampling: SamplingConfig) -> SamplingParams:
    """The sampling parameters as stamped on a group (what the learner applies to its log-probs)."""
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
    )


def make_group(
    prompt: Prompt,
    prompt_ids: np.ndarray,
    completions: Sequence[Completion],
    reward_fn: RewardFn,
    policy_version: int,
    actor_id: str,
    sampling: SamplingParams,
) -> TrajectoryGroup:
    """Score the completions of one prompt and stamp them as a group; `RewardError` if any score fails."""
    rewards = [score(reward_fn, c.text, prompt.answer, prompt.metadata) for c in completions]
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex,
        prompt_id=prompt.prompt_id,
        prompt_ids=prompt_ids,
        policy_version=policy_version,
        actor_id=actor_id,
        created_at=time.time(),
        sampling=sampling,
        trajectories=[
            Trajectory(c.token_ids, c.logprobs, r, c.finish_reason)
            for c, r in zip(completions, rewards, strict=True)
        ],
        metadata=dict(prompt.metadata),
    )


def make_groups(
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[np.ndarray],
    completions: Sequence[Sequence[Completion]],
    reward_fn: RewardFn,
    policy_version: int,
    actor_id: str,
    sampling: SamplingParams,
    metrics: ActorMetrics,
) -> list[TrajectoryGroup]:
    """`make_group` for each prompt of a batch; a group whose reward fails is counted and left out."""
    groups = []
    for prompt, ids, comps in zip(prompts, prompt_ids, completions, strict=True):
        try:
            group = make_group(prompt, ids, comps, reward_fn, policy_version, actor_id, sampling)
        except RewardError as e:
            metrics.failures.labels("reward_error").inc()
            log.warning("prompt %s: reward failed, group dropped: %s", prompt.prompt_id, e)
            continue
        for t in group.trajectories:
            metrics.reward.observe(t.reward)
        groups.append(group)
    return groups


async def sleep_unless_stopped(seconds: float, stop: threading.Event) -> bool:
    """Sleep up to `seconds`, waking early when `stop` is set; True when stopped."""
    deadline = time.monotonic() + seconds
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(left, _STOP_POLL_S))
    return stop.is_set()


async def _backoff(
    reason: str, delay: float, retry: RetryConfig, metrics: ActorMetrics, stop: threading.Event
) -> float:
    t0 = time.monotonic()
    await sleep_unless_stopped(delay, stop)
    metrics.buffer_wait.labels(reason).inc(time.monotonic() - t0)
    return min(delay * 2, retry.max_s)


async def wait_for_room(
    buffer: AsyncReplayBuffer,
    policy_version: int,
    retry: RetryConfig,
    metrics: ActorMetrics,
    stop: threading.Event,
) -> None:
    """Producer pacing: return once the buffer has room for groups of `policy_version` (or on stop)."""
    delay = retry.initial_s
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            await buffer.wait_for_room(policy_version, retry.pacing_timeout_s)
            metrics.buffer_wait.labels("pacing").inc(time.monotonic() - t0)
            return
        except RateLimited:
            metrics.buffer_wait.labels("pacing").inc(time.monotonic() - t0)
            log.info("buffer holds max_ahead fresh groups for %.0f s; still waiting", retry.pacing_timeout_s)
        except StorageUnavailable as e:
            metrics.failures.labels("redis_unavailable").inc()
            log.warning("pacing check: Redis unavailable (%s); retrying in %.1f s", e, delay)
            delay = await _backoff("redis_unavailable", delay, retry, metrics, stop)


async def push_groups(
    buffer: AsyncReplayBuffer,
    groups: Sequence[TrajectoryGroup],
    retry: RetryConfig,
    metrics: ActorMetrics,
    stop: threading.Event,
) -> int:
    """Insert `groups`, retrying through Redis outages and rate limiting; return how many were new.

    Retries are safe: inserts are idempotent by `group_id`. Invalid groups are counted and logged (the
    buffer names the field); they are bugs, never retried. Groups still unpushed at stop are counted.
    """
    pending, inserted, delay = list(groups), 0, retry.initial_s
    while pending:
        if stop.is_set():
            metrics.failures.labels("dropped_on_stop").inc(len(pending))
            log.error("stopped with %d generated groups not pushed (Redis unavailable)", len(pending))
            return inserted
        try:
            result = await buffer.insert_many(pending)
        except StorageUnavailable as e:
            metrics.failures.labels("redis_unavailable").inc()
            log.warning(
                "insert: Redis unavailable (%s); retrying %d groups in %.1f s", e, len(pending), delay
            )
            delay = await _backoff("redis_unavailable", delay, retry, metrics, stop)
            continue
        except RateLimited as e:
            log.info("insert rate limited (%s); retrying in %.1f s", e, delay)
            delay = await _backoff("rate_limited", delay, retry, metrics, stop)
            continue
        for gid, field in result.rejected.items():
            metrics.failures.labels("invalid_group").inc()
            log.error("buffer rejected group %s as invalid: %s", gid, field)
        inserted += len(result.inserted)
        metrics.groups_pushed.inc(len(result.inserted))
        metrics.duplicates.inc(len(result.duplicates))
        pending = []
    return inserted
