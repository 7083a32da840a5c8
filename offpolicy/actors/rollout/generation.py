"""One prompt from admission to the pusher: its request in the engine (or its episodes), scoring, stamping.

`PromptGeneration` is mixed into `Actor` (rollout/loop.py): the admission loop there calls `_encode` and
`_admit`; each admitted prompt is one task here that generates its group (one request of `sampling.n`
completions, or `sampling.n` episodes of an environment), frees its engine slot as soon as the engine is
done with it, scores the completions off the engine's loop, stamps the group with the versions and the
sampling it was admitted with, and hands it to `submit`. A prompt that fails in the engine is counted and
skipped; one aborted by a reload is generated again; a failed reward or environment sets its group aside.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from offpolicy.actors.config import ActorConfig, SamplingConfig
from offpolicy.actors.data.prompts import Prompt, encode
from offpolicy.actors.errors import EngineError, PromptFailed, RewardError
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.episodes import Environment, Episode, as_result
from offpolicy.actors.rollout.scoring import RewardFailures, Scorer
from offpolicy.actors.rollout.submit import stamp_group, stamped_sampling
from offpolicy.buffer.types import TrajectoryGroup

if TYPE_CHECKING:
    from offpolicy.actors.engine.vllm import VLLMEngine

log = logging.getLogger(__name__)
_RATE_WINDOW_S = 2.0  # tokens/s is measured over windows at least this long


class PromptGeneration:
    """`Actor`'s per-prompt methods. The actor sets `config`, `engine`, `metrics`, `scorer`,
    `reward_failures`, `environment` (None: plain completions), `actor_id`, `tokens_per_s` and the loop's
    bookkeeping (`_inflight`, `_scoring`, `_readmit`, `_fatal`, `_wake`, `_window`), and provides `submit`
    and `request_params`."""

    config: ActorConfig
    engine: VLLMEngine
    metrics: ActorMetrics
    scorer: Scorer
    reward_failures: RewardFailures
    environment: Environment | None
    actor_id: str
    tokens_per_s: float | None
    _inflight: dict[str, asyncio.Task]  # request id -> its task, while in the engine
    _scoring: dict[str, asyncio.Task]  # request id -> its task, generated and being scored
    _readmit: collections.deque[Prompt]  # aborted prompts, first in line
    _fatal: BaseException | None
    _wake: asyncio.Event
    _window: tuple[float, int]  # (start, tokens) of the current tokens/s window
    submit: Callable[[TrajectoryGroup], None]
    request_params: Callable[[Prompt], Any]

    def _encode(self, prompt: Prompt) -> np.ndarray | None:
        """Token ids of a prompt; None (counted) when it leaves no room for `max_tokens`."""
        cfg = self.config
        assert cfg.dataset is not None  # prompts come from the dataset
        room = cfg.engine.max_model_len - cfg.sampling.max_tokens
        tokens = encode(self.engine.tokenizer, prompt, cfg.dataset.chat_template, cfg.dataset.system_prompt)
        if len(tokens) > room:
            self.metrics.failures.labels("prompt_too_long").inc()
            log.warning("prompt %s: %d tokens > %d available; skipped", prompt.prompt_id, len(tokens), room)
            return None
        return np.asarray(tokens, dtype=np.int32)

    def _admit(self, prompt: Prompt, ids: np.ndarray) -> None:
        request_id = uuid.uuid4().hex
        # the sampling of the admission: a request keeps it, and its group is stamped with it
        sampling, params = self.config.sampling, self.request_params(prompt)
        task = asyncio.create_task(
            self._run_prompt(request_id, prompt, ids, self.engine.loaded_version, sampling, params)
        )
        self._inflight[request_id] = task
        self.metrics.inflight.set(len(self._inflight))
        task.add_done_callback(lambda t, rid=request_id: self._done(rid, t))

    def _done(self, request_id: str, task: asyncio.Task) -> None:
        self._inflight.pop(request_id, None)
        self._scoring.pop(request_id, None)
        self.metrics.inflight.set(len(self._inflight))
        if not task.cancelled() and task.exception() is not None and self._fatal is None:
            self._fatal = task.exception()  # raised by the admission loop
        self._wake.set()

    async def _run_prompt(
        self, request_id: str, prompt: Prompt, ids: np.ndarray, version: int, sampling: SamplingConfig, params
    ) -> None:
        """Generate one prompt's group, score and stamp it, hand it to the pusher (or re-admit it)."""
        t0 = time.perf_counter()
        if self.environment is not None:
            await self._run_episodes(prompt, ids, version, t0, sampling)
            return
        try:
            completions = await self.engine.generate_group(request_id, ids, params)
        except PromptFailed as e:  # this prompt only: counted and skipped, the loop goes on
            self.metrics.failures.labels("engine_error").inc()
            log.warning("prompt %s skipped: %s", prompt.prompt_id, e)
            return
        tokens = sum(len(c.token_ids) for c in completions)
        if any(c.finish_reason == "abort" for c in completions):  # reload.mode=abort: generate it again
            self.metrics.aborted_tokens.inc(tokens)
            self._readmit.append(prompt)
            return
        self._count_tokens(tokens, time.perf_counter() - t0)
        self._release_slot(request_id)  # the engine takes the next prompt while this group is scored
        try:  # off this loop (the engine's): the engine goes on generating meanwhile
            rewards = await self.scorer.score(prompt, [c.text for c in completions])
        except RewardError as e:
            self.reward_failures.failed(e.reason)
            log.warning("prompt %s: reward failed (%s), group dropped: %s", prompt.prompt_id, e.reason, e)
            return
        self.reward_failures.scored()
        stamp = stamped_sampling(sampling)
        self.submit(stamp_group(prompt, ids, completions, rewards, version, self.actor_id, stamp))

    async def _run_episodes(
        self, prompt: Prompt, ids: np.ndarray, version: int, t0: float, sampling: SamplingConfig
    ) -> None:
        """`sampling.n` episodes of the environment on one prompt, run concurrently: one group."""

        def params_for(max_tokens: int, **overrides: Any) -> Any:  # overrides: an episode's `stop`, ...
            return self.engine.sampling_params(sampling, n=1, max_tokens=max_tokens, **overrides)

        episodes = [
            Episode(prompt, ids, self.engine, self.engine.tokenizer, params_for, sampling.max_tokens, version)
            for _ in range(sampling.n)
        ]
        assert self.environment is not None
        try:
            results = await asyncio.gather(*(self.environment(ep) for ep in episodes))
        except PromptFailed as e:
            self.metrics.failures.labels("engine_error").inc()
            log.warning("prompt %s skipped: %s", prompt.prompt_id, e)
            return
        except EngineError:
            raise  # the engine itself is gone: the actor's fatal error, not one group's
        except Exception as e:  # translated: a user's environment may raise anything; its group is set aside
            self.reward_failures.failed("environment")
            log.warning(
                "prompt %s: an episode failed, group dropped: %s: %s", prompt.prompt_id, type(e).__name__, e
            )
            return
        completions = [ep.completion() for ep in episodes]
        self._count_tokens(sum(len(c.token_ids) for c in completions), time.perf_counter() - t0)
        try:
            rewards = [as_result(r).reward for r in results]
        except RewardError as e:
            self.reward_failures.failed("environment")
            log.warning("prompt %s: %s; group dropped", prompt.prompt_id, e)
            return
        self.reward_failures.scored()
        stamp = stamped_sampling(sampling)
        self.submit(stamp_group(prompt, ids, completions, rewards, version, self.actor_id, stamp))

    def _release_slot(self, request_id: str) -> None:
        """A prompt's request left the engine: its task moves to the scoring set, the loop may admit."""
        task = self._inflight.pop(request_id, None)
        if task is not None:
            self._scoring[request_id] = task
            self.metrics.inflight.set(len(self._inflight))
            self._wake.set()

    def _count_tokens(self, tokens: int, seconds: float) -> None:
        self.metrics.tokens.inc(tokens)
        self.metrics.batch_seconds.observe(seconds)
        start, count = self._window
        now, count = time.perf_counter(), count + tokens
        if now - start >= _RATE_WINDOW_S:
            self.tokens_per_s = count / (now - start)
            self.metrics.tokens_per_s.set(self.tokens_per_s)
            start, count = now, 0
        self._window = (start, count)
