"""One prompt from admission to the pusher: its request in the engine (or its episodes), scoring, stamping.

`PromptGeneration` owns the prompts the actor (rollout/actor.py) has admitted: their tasks while in the
engine (`inflight`) and while scored (`scoring`), the prompts to generate again (`readmit`) and the tokens/s
window. The actor's admission loop calls `encode` and `admit`; each admitted prompt is one task here that
generates its group (one request of `sampling.n` completions, or `sampling.n` episodes of an environment),
frees its engine slot as soon as the engine is done with it, scores the completions off the engine's loop,
stamps the group with the versions and the sampling it was admitted with, and hands it to `submit`. A
prompt that fails in the engine is counted and skipped; one aborted by a reload is generated again; a failed
reward or environment sets its group aside. It sees the actor only through the callables it is given:
`submit` (the pusher), `wake` (the admission loop) and `on_error` (a task's unexpected error, the actor's
fatal one).
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

from offpolicy.actors.data.images import decoded_images
from offpolicy.actors.data.prompts import Prompt, encode
from offpolicy.actors.errors import EngineError, PromptFailed, RewardError
from offpolicy.actors.rollout.episodes import Environment, Episode, as_result
from offpolicy.actors.rollout.submit import stamp_group, stamped_sampling

if TYPE_CHECKING:
    from offpolicy.actors.config import DatasetConfig, SamplingConfig
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.actors.rollout.scoring import RewardFailures, Scorer
    from offpolicy.buffer.types import TrajectoryGroup

log = logging.getLogger(__name__)
_RATE_WINDOW_S = 2.0  # tokens/s is measured over windows at least this long


class PromptGeneration:
    """The actor's admitted prompts, each generated, scored and stamped into one group (module docstring).

    Built once per actor with what it uses: the `engine`, `metrics`, the `scorer` and `reward_failures`,
    the `environment` (None: plain completions), the `actor_id` stamped on groups, the `dataset` prompts are
    encoded with (None: an actor without one never encodes) and the engine's `max_model_len`. Runs on the
    engine's event loop.
    """

    def __init__(
        self,
        engine: VLLMEngine,
        metrics: ActorMetrics,
        scorer: Scorer,
        reward_failures: RewardFailures,
        environment: Environment | None,
        actor_id: str,
        dataset: DatasetConfig | None,
        max_model_len: int,
        submit: Callable[[TrajectoryGroup], None],
        wake: Callable[[], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.scorer = scorer
        self.reward_failures = reward_failures
        self.environment = environment
        self.actor_id = actor_id
        self.dataset = dataset
        self.max_model_len = max_model_len
        self._submit, self._wake, self._on_error = submit, wake, on_error
        self.inflight: dict[str, asyncio.Task] = {}  # request id -> its task, while in the engine
        self.scoring: dict[str, asyncio.Task] = {}  # request id -> its task, generated and being scored
        self.readmit: collections.deque[Prompt] = collections.deque()  # aborted prompts, first in line
        self.tokens_per_s: float | None = None  # over the last window of at least _RATE_WINDOW_S
        self._window = (time.perf_counter(), 0)  # (start, tokens) of the current tokens/s window

    # --- what the admission loop calls

    def encode(self, prompt: Prompt, sampling: SamplingConfig) -> np.ndarray | None:
        """Token ids of a prompt; None (counted) when it leaves no room for `sampling.max_tokens`."""
        assert self.dataset is not None  # prompts come from the dataset
        room = self.max_model_len - sampling.max_tokens
        tokens = encode(self.engine.tokenizer, prompt, self.dataset.chat_template, self.dataset.system_prompt)
        if len(tokens) > room:
            self.metrics.failures.labels("prompt_too_long").inc()
            log.warning("prompt %s: %d tokens > %d available; skipped", prompt.prompt_id, len(tokens), room)
            return None
        return np.asarray(tokens, dtype=np.int32)

    def admit(self, prompt: Prompt, ids: np.ndarray, sampling: SamplingConfig, params: Any) -> None:
        """Start generating `prompt` with the sampling of its admission (`params`: its vLLM parameters); its
        request keeps that sampling, and its group is stamped with it and the version loaded now."""
        request_id = uuid.uuid4().hex
        version = self.engine.loaded_version
        task = asyncio.create_task(self._run_prompt(request_id, prompt, ids, version, sampling, params))
        self.inflight[request_id] = task
        self.metrics.inflight.set(len(self.inflight))
        task.add_done_callback(lambda t, rid=request_id: self._done(rid, t))

    def next_readmitted(self) -> Prompt | None:
        """The oldest prompt aborted by a reload (it is generated again before new ones), or None."""
        return self.readmit.popleft() if self.readmit else None

    @property
    def idle(self) -> bool:
        """Nothing in the engine and nothing being scored."""
        return not self.inflight and not self.scoring

    async def cancel(self) -> None:
        """Stop every in-flight request (cancelling a request aborts it in the engine) and every scoring."""
        await cancel_and_wait([*self.inflight.values(), *self.scoring.values()])

    # --- one prompt

    def _done(self, request_id: str, task: asyncio.Task) -> None:
        self.inflight.pop(request_id, None)
        self.scoring.pop(request_id, None)
        self.metrics.inflight.set(len(self.inflight))
        if not task.cancelled() and task.exception() is not None:
            self._on_error(task.exception())  # the actor's fatal error: raised by its admission loop
        self._wake()

    async def _run_prompt(
        self, request_id: str, prompt: Prompt, ids: np.ndarray, version: int, sampling: SamplingConfig, params
    ) -> None:
        """Generate one prompt's group, score and stamp it, hand it to the pusher (or re-admit it)."""
        t0 = time.perf_counter()
        if self.environment is not None:
            await self._run_episodes(prompt, ids, version, t0, sampling)
            return
        try:
            shown = {"images": decoded_images(prompt)} if prompt.images else {}  # a vision-language prompt
            completions = await self.engine.generate_group(request_id, ids, params, **shown)
        except PromptFailed as e:  # this prompt only: counted and skipped, the loop goes on
            self.metrics.failures.labels("engine_error").inc()
            log.warning("prompt %s skipped: %s", prompt.prompt_id, e)
            return
        tokens = sum(len(c.token_ids) for c in completions)
        if any(c.finish_reason == "abort" for c in completions):  # reload.mode=abort: generate it again
            self.metrics.aborted_tokens.inc(tokens)
            self.readmit.append(prompt)
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
        self._submit(stamp_group(prompt, ids, completions, rewards, version, self.actor_id, stamp))

    async def _run_episodes(
        self, prompt: Prompt, ids: np.ndarray, version: int, t0: float, sampling: SamplingConfig
    ) -> None:
        """`sampling.n` episodes of the environment on one prompt, run concurrently: one group."""

        def params_for(max_tokens: int, **overrides: Any) -> Any:  # overrides: an episode's `stop`, ...
            return self.engine.sampling_params(sampling, n=1, max_tokens=max_tokens, **overrides)

        tok, budget, shown = self.engine.tokenizer, sampling.max_tokens, prompt.images
        episodes = [
            Episode(prompt, ids, self.engine, tok, params_for, budget, version, images=shown)
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
        if prompt.images:  # the prompt as the engine ran it: each image's placeholder widened
            ids = next((np.asarray(ep.prompt_ids, np.int32) for ep in episodes if ep.turns), ids)
        self._submit(stamp_group(prompt, ids, completions, rewards, version, self.actor_id, stamp))

    def _release_slot(self, request_id: str) -> None:
        """A prompt's request left the engine: its task moves to the scoring set, the loop may admit."""
        task = self.inflight.pop(request_id, None)
        if task is not None:
            self.scoring[request_id] = task
            self.metrics.inflight.set(len(self.inflight))
            self._wake()

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


async def cancel_and_wait(tasks: list[asyncio.Task]) -> None:
    """Cancel `tasks` and wait for them to end. A task that swallowed the cancel (on Python 3.11 a
    library's own read timeout can turn an outside cancel into its timeout and carry on) is cancelled
    again each second, so shutting down never hangs on it."""
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=1.0)
    await asyncio.gather(*tasks, return_exceptions=True)  # retrieve their errors: ended, not lost
