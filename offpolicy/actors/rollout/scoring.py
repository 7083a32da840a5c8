"""Scoring a group's completions off the engine's event loop: sync functions on a worker pool, async ones
awaited, batched per group or per completion, under one timeout; or a remote verifier over HTTP.

The actor's event loop also drives vLLM's output handling, so nothing here blocks it: a 200 ms verifier
call or a slow Python reward runs while the engine goes on generating. `Scorer.score` returns one finite
float per completion, or raises `RewardError` (the group is set aside as `reward_error`, counted).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from offpolicy.actors.errors import RewardError
from offpolicy.actors.metrics import REWARD_FAILURE_REASONS
from offpolicy.actors.rollout.rewards import (
    Score,
    from_verl,
    length_penalty,
    resolve_reward,
    score,
    signature_of,
)

if TYPE_CHECKING:
    from offpolicy.actors.config import RemoteRewardConfig, RewardConfig
    from offpolicy.actors.data.prompts import Prompt
    from offpolicy.actors.metrics import ActorMetrics

log = logging.getLogger(__name__)
ALARM_AFTER_GROUPS = 20  # scored groups before the share of failed ones is judged
ALARM_SHARE = 0.5  # more than this share failed: the dataset (or the reward) is broken


@dataclass(frozen=True, slots=True)
class RewardSample:
    """What a reward function of `signature: sample` gets for one completion."""

    prompt_id: str
    prompt: str  # the prompt's text
    completion: str
    answer: str | None
    metadata: Mapping[str, str]


class Scorer:
    """The configured reward, run off the event loop; `close()` stops its threads and HTTP client."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="offpolicy-reward")
        self._remote = RemoteReward(config.remote) if config.remote is not None else None
        self._fn: Callable[..., Any] | None = None
        self.signature = config.signature or "text"  # how `_fn` is called (verl's: adapted to `text`)
        if self._remote is None:
            fn = resolve_reward(config.name)
            self.signature = signature_of(fn, config.signature)
            if self.signature == "verl":
                fn, self.signature = from_verl(fn), "text"
            if config.length_penalty is not None:
                fn = length_penalty(fn, config.length_penalty, config.length_max_chars)
            self._fn = fn
        self.name = config.name

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        """One finite reward per completion of `prompt`; `RewardError` for anything else or a timeout."""
        try:
            values = await asyncio.wait_for(self._call(prompt, completions), self.config.timeout_s)
        except TimeoutError as exc:
            raise RewardError(f"{self.name}: no reward within {self.config.timeout_s} s", "timeout") from exc
        values = list(values)
        if len(values) != len(completions):
            raise RewardError(
                f"{self.name} returned {len(values)} rewards for {len(completions)} completions",
                "wrong_count",
            )
        return [_finite(v, self.name) for v in values]

    async def _call(self, prompt: Prompt, completions: Sequence[str]) -> Sequence[Any]:
        if self._remote is not None:
            return await self._remote.score(prompt, completions)
        samples = [
            RewardSample(prompt.prompt_id, prompt.text, c, prompt.answer, prompt.metadata)
            for c in completions
        ]
        if self.config.batched:
            args = (
                (samples,)
                if self.signature == "sample"
                else (list(completions), prompt.answer, prompt.metadata)
            )
            return await self._run(*args)
        if self.signature == "sample":
            return await asyncio.gather(*(self._run(s) for s in samples))
        return await asyncio.gather(*(self._run(c, prompt.answer, prompt.metadata) for c in completions))

    async def _run(self, *args: Any) -> Any:
        """The function on `args`: awaited when it is a coroutine function, else on the pool's threads."""
        fn = self._fn
        assert fn is not None
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            if self.signature == "text" and not self.config.batched:
                return await asyncio.get_running_loop().run_in_executor(self._pool, score, fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        except RewardError:
            raise
        except Exception as exc:  # translated: a user reward function may raise anything
            raise RewardError(f"{self.name} raised {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        """End of a run: close the HTTP client (the next run opens another on its own loop)."""
        if self._remote is not None:
            await self._remote.aclose()

    def close(self) -> None:
        """Stop the worker threads (a function still running finishes on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class RewardFailures:
    """Groups whose reward failed, counted by reason (`offpolicy_actor_reward_failures_total{reason}` and
    `failures_total{reason="reward_error"}`); the alarm when most groups fail.

    One failing group is a warning; a dataset whose answers the reward cannot read fails nearly every
    group, so once `ALARM_AFTER_GROUPS` groups were scored and more than `ALARM_SHARE` of them failed,
    one ERROR is logged with the commonest reason and its count, and `status()["alarm"]` (and the gauge
    `offpolicy_actor_reward_failure_alarm`: the `OffpolicyRewardFailing` alert) says so while the share
    stays above it."""

    def __init__(self, metrics: ActorMetrics) -> None:
        self.metrics = metrics
        self.groups = 0  # groups scored or failed
        self.by_reason = dict.fromkeys(REWARD_FAILURE_REASONS, 0)
        self._logged = False

    def scored(self) -> None:
        """A group got its rewards."""
        self.groups += 1
        self.metrics.reward_failure_alarm.set(0.0 if self.alarm() is None else 1.0)

    def failed(self, reason: str) -> None:
        """A group was set aside because its reward failed for `reason` (`RewardError.reason`)."""
        if reason not in self.by_reason:
            raise ValueError(f"unknown reward failure reason {reason!r}; one of {REWARD_FAILURE_REASONS}")
        self.groups += 1
        self.by_reason[reason] += 1
        self.metrics.failures.labels("reward_error").inc()
        self.metrics.reward_failures.labels(reason).inc()
        alarm = self.alarm()
        self.metrics.reward_failure_alarm.set(0.0 if alarm is None else 1.0)
        if alarm is not None and not self._logged:
            self._logged = True
            log.error("%s", alarm)

    def alarm(self) -> str | None:
        """Why most groups fail, once `ALARM_AFTER_GROUPS` were scored; None while they mostly score."""
        failed = sum(self.by_reason.values())
        if self.groups < ALARM_AFTER_GROUPS or failed <= ALARM_SHARE * self.groups:
            return None
        reason, count = max(self.by_reason.items(), key=lambda kv: kv[1])
        return (
            f"rewards failed for {failed} of {self.groups} groups; most often {reason!r} ({count} groups): "
            "check the dataset's answers (dataset.answer_key) and the reward (offpolicy data preview)"
        )

    def status(self) -> dict[str, Any]:
        """Failed groups by reason (those that happened) and the alarm, for `/v1/status`."""
        return {
            "reward_failures": {k: v for k, v in self.by_reason.items() if v},
            "reward_failure_alarm": self.alarm(),
        }


class RemoteReward:
    """A verifier over HTTP: one POST per group, `concurrency` at a time, bounded retries."""

    def __init__(self, config: RemoteRewardConfig) -> None:
        self.config = config
        token = os.environ.get(config.token_env, "") if config.token_env else ""
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client: httpx.AsyncClient | None = None  # opened on the loop that uses it
        self._slots: asyncio.Semaphore | None = None

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[Any]:
        body = {
            "prompt_id": prompt.prompt_id,
            "prompt": prompt.text,
            "completions": list(completions),
            "answer": prompt.answer,
            "metadata": dict(prompt.metadata),
        }
        if self._client is None or self._slots is None:
            self._client = httpx.AsyncClient(timeout=self.config.timeout_s, headers=self._headers)
            self._slots = asyncio.Semaphore(self.config.concurrency)
        delay, last = 0.2, "no attempt"
        async with self._slots:
            for attempt in range(self.config.retries + 1):
                try:
                    response = await self._client.post(self.config.url, json=body)
                except httpx.HTTPError as exc:  # transport trouble or a timeout: retried
                    last = f"{type(exc).__name__}: {exc}"
                else:
                    if response.status_code < 500:
                        return _rewards(response)
                    last = f"HTTP {response.status_code}"
                if attempt < self.config.retries:
                    log.warning(
                        "remote reward %s failed (%s); retrying in %.1f s", self.config.url, last, delay
                    )
                    await asyncio.sleep(delay)
                    delay *= 2
        raise RewardError(
            f"remote reward {self.config.url}: {last} after {self.config.retries + 1} attempt(s)", "remote"
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        self._client, self._slots = None, None


def _rewards(response: httpx.Response) -> list[Any]:
    if response.status_code >= 400:
        raise RewardError(
            f"remote reward answered HTTP {response.status_code}: {response.text[:200]}", "remote"
        )
    try:
        rewards = response.json()["rewards"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RewardError(
            f"remote reward answered without a `rewards` list: {response.text[:200]}", "remote"
        ) from exc
    if not isinstance(rewards, list):
        raise RewardError(f"remote reward: `rewards` is {type(rewards).__name__}, not a list", "remote")
    return rewards


def _finite(value: Any, who: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(f"{who} returned {value!r}, not a finite number", "not_finite")
    return value if isinstance(value, Score) else float(value)
