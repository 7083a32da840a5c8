"""The actor's rollout loop, top to bottom: a stream of prompts through vLLM's async engine into the buffer.

Up to `max_inflight_prompts` prompts are in the engine at once, each one request of `sampling.n`
completions. When a prompt's completions are all done, its engine slot is free and the next prompt is
admitted while the group is scored (off the engine's loop: up to 4 x `max_inflight_prompts` groups wait on
the reward function or a remote verifier at once), then stamped and handed to the pusher: the engine's batch
stays full, and neither a long completion nor a slow verifier holds the others back. Before each admission
the loop applies a newer published version (`reload.mode`: `drain`, `abort` or `inflight`), waits while
the buffer holds `max_ahead` fresh groups (pacing), and waits while the pusher is behind (Redis down or
the rate limiter saying no: groups are kept, never dropped). An engine serving LoRA adapters
(`engine.lora`) takes a new adapter without draining: requests in flight finish on theirs. The service
hosts `Actor.run(stop_event)` in a thread and reads `Actor.status()`. What happens to one admitted prompt
(its request, scoring, stamping) is rollout/generation.py: the actor holds one `PromptGeneration`, which
owns the prompts in flight and sees the actor only through the callables it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import ChainMap
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ActorConfig
from offpolicy.actors.data.evaluation import Evaluator
from offpolicy.actors.data.prompts import Prompt, epoch_batches, load_prompts, shard, text_only
from offpolicy.actors.engine.vllm import VLLMEngine
from offpolicy.actors.errors import ActorNotRunning, DatasetError
from offpolicy.actors.gateway.agent_episodes import Gateway
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.episodes import resolve_environment
from offpolicy.actors.rollout.generation import PromptGeneration, cancel_and_wait
from offpolicy.actors.rollout.scoring import RewardFailures, Scorer
from offpolicy.actors.rollout.submit import push_groups, stamped_sampling, wait_for_room
from offpolicy.actors.transport.receiver import start_receiver
from offpolicy.actors.transport.weight_sync import WeightSync
from offpolicy.buffer.errors import StorageUnavailable
from offpolicy.buffer.evaluations import AsyncEvalStore
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer
from offpolicy.buffer.types import TrajectoryGroup
from offpolicy.weights.processor import is_vision_checkpoint
from offpolicy.weights.record import AsyncPolicyStore

log = logging.getLogger(__name__)
_WAKE_S = 0.05  # longest the admission loop sleeps without re-checking stop and the policy record
_SCORING_PER_SLOT = 4  # groups being scored per engine slot before admission waits (a slow verifier)
_PUSH_LINGER_S = 0.05  # a group waits at most this long for others to share its insert (Redis round trip)


def vision_dataset(config: ActorConfig) -> bool:
    """Whether the dataset's images go to the model: it reads images, and the model is a vision one."""
    return (
        config.dataset is not None
        and config.dataset.image_key is not None
        and is_vision_checkpoint(config.model_path)
    )


class Actor:
    """One actor: an engine, this actor's prompt shard and a reward function, feeding one buffer."""

    def __init__(
        self, config: ActorConfig, registry: CollectorRegistry, engine: VLLMEngine | None = None
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = ActorMetrics(registry)
        self.actor_id = config.resolved_actor_id
        self.scorer = Scorer(config.reward)  # an unknown reward fails here, at start-up
        self.reward_failures = RewardFailures(self.metrics)
        env = config.environment
        self.environment = resolve_environment(env.name) if env is not None else None
        self.prompts = (
            []
            if config.dataset is None
            else shard(
                text_only(load_prompts(config.dataset), config.dataset.path, vision_dataset(config)),
                config.actor_index,
                config.num_actors,
            )
        )
        # the encoded images of the shard's prompts, by sha256: sent with the groups that show them
        self.images = {im.sha256: im.data for p in self.prompts for im in p.images}
        if config.dataset is not None and not self.prompts:
            raise DatasetError(
                f"actor {config.actor_index}/{config.num_actors} has an empty shard of {config.dataset.path}"
            )
        self._owns_engine = engine is None
        transfer = config.reload.transfer.backend if config.reload.transport == "vllm" else None
        self.engine = engine or VLLMEngine(
            config.engine,
            config.model_path,
            config.reload.initial_version,
            config.actor_index,
            transfer_backend=transfer,
        )
        if self.engine.adapters is not None:
            adapters = self.engine.adapters
            self.metrics.adapters.set_function(lambda: len(adapters.held))
        self.sync: WeightSync | None = None
        self._receiver: asyncio.Task | None = None  # the TransferReceiver's task (reload.transport: vllm)
        self.gateway = Gateway(self) if config.gateway.enabled else None
        self.evaluator = (
            Evaluator(config, self.engine, self.scorer, self.environment) if config.eval is not None else None
        )
        self._eval_task: asyncio.Task | None = None
        self.stamp = stamped_sampling(config.sampling)  # the sampling stamped on every group
        self._loop_running = False
        self.state = "idle"
        self.groups_pushed = 0
        self._pending: list[TrajectoryGroup] = []  # scored groups the pusher has not taken yet
        self._pending_images: dict[str, bytes] = {}  # the images they show beyond the dataset's (gateway)
        self._fatal: BaseException | None = None  # a task's error: raised by the admission loop
        self._wake, self._push_wake = asyncio.Event(), asyncio.Event()  # the admission loop's, the pusher's
        self.generation = PromptGeneration(
            self.engine,
            self.metrics,
            self.scorer,
            self.reward_failures,
            self.environment,
            self.actor_id,
            config.dataset,
            config.engine.max_model_len,
            submit=self.submit,
            wake=self._wake.set,
            on_error=self._fail,
        )

    # --- the service's view

    def status(self) -> dict[str, Any]:
        """Loaded policy version (with `engine.lora`: the newest adapter's, and the adapters held), the
        learner's newest, a record refused for its kind, recent tokens/s, groups pushed, reloads, reward
        failures by reason and the alarm when most groups fail."""
        latest = None if self.sync is None or self.sync.latest is None else self.sync.latest.version
        refused = None if self.sync is None or self.sync.refused is None else str(self.sync.refused)
        return {
            "state": self.state,
            "actor_id": self.actor_id,
            "loaded_policy_version": self.engine.loaded_version,
            "policy_kind": self.engine.kind,
            **({} if self.engine.adapters is None else self.engine.adapters.status()),
            "refused_record": refused,
            "learner_policy_version": latest,
            "tokens_per_s": self.generation.tokens_per_s,
            "groups_pushed": self.groups_pushed,
            "reloads": 0 if self.sync is None else self.sync.reloads,
            "mode": self.config.mode,
            "last_eval": None
            if self.evaluator is None or self.evaluator.last is None
            else {k: v if math.isfinite(v) else None for k, v in self.evaluator.last.metrics().items()},
            **self.reward_failures.status(),
        }

    def run(self, stop_event: threading.Event) -> None:
        """Run the loop in this thread until `stop_event` is set (or `dataset.max_epochs` passes)."""
        asyncio.run(self.arun(stop_event))

    def close(self) -> None:
        """Shut down the vLLM engine if this actor built it (its engine-core process would outlive us)."""
        self.scorer.close()
        if self.evaluator is not None:
            self.evaluator.close()
        if self._owns_engine:
            self.engine.shutdown()

    def request_params(self, prompt: Prompt) -> Any:
        """The vLLM sampling parameters of `prompt`'s request (benchmarks override this)."""
        return self._params

    def reconfigure(self, config: ActorConfig) -> None:
        """Take `config`'s `max_inflight_prompts` and `sampling` from the next admission on (a pool's run
        updated while it runs; the other fields must be this config's). Requests in flight keep the
        sampling they were admitted with, and their groups are stamped with it. `InvalidSampling` when vLLM
        refuses the sampling (nothing changed then)."""
        self.engine.call(self._reconfigure(config))

    async def _reconfigure(self, config: ActorConfig) -> None:  # on the engine's loop, between admissions
        params = self.engine.sampling_params(config.sampling)
        self.config, self.stamp, self._params = config, stamped_sampling(config.sampling), params

    # --- the loop

    async def arun(self, stop: threading.Event) -> None:
        """The rollout loop (asyncio); `run` is its synchronous entry point. It runs on the engine's event
        loop (one thread for the engine's output handling and the actor: no thread hop per request)."""
        await self.engine.acall(self._arun(stop))

    async def _arun(self, stop: threading.Event) -> None:
        cfg = self.config
        buffer = AsyncReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer, self.registry)
        store = AsyncPolicyStore(cfg.redis_url, cfg.run_id, cfg.buffer.storage_timeout_s)
        self._evals = AsyncEvalStore(cfg.redis_url, cfg.run_id, cfg.buffer.storage_timeout_s)
        self.sync = WeightSync(store, self.engine, cfg.reload, cfg.retry, self.metrics)
        watcher = asyncio.create_task(self.sync.watch()) if cfg.reload.enabled else None  # the policy record
        self._receiver = (  # transport vllm
            start_receiver(cfg, self.actor_id, self.engine, self.registry, store, self._fail)
            if cfg.reload.enabled
            else None
        )
        self._params = self.engine.sampling_params(cfg.sampling)
        self._pending, self._pending_images, self._fatal = [], {}, None
        closing = asyncio.Event()
        pusher = asyncio.create_task(self._push_loop(buffer, stop, closing))
        expiry = asyncio.create_task(self.gateway.expire_loop()) if self.gateway is not None else None
        self.state, finished, self._loop_running = "running", False, True
        try:
            if cfg.reload.enabled:  # no request before the newest published policy is loaded
                await self.sync.catch_up(stop)
            await self._admit_loop(buffer, stop)
            finished = True
        finally:
            self._loop_running = False
            if not finished:
                stop.set()  # failing: the pusher tries each insert once more, then gives up (counted)
            if expiry is not None:
                await cancel_and_wait([expiry])
            if self._eval_task is not None:
                await cancel_and_wait([self._eval_task])
            await self.generation.cancel()
            closing.set()
            self._push_wake.set()
            await pusher
            if watcher is not None:
                await cancel_and_wait([watcher] + ([self._receiver] if self._receiver is not None else []))
            await self.sync.close()
            await store.close()
            await self._evals.close()
            await buffer.close()
            await self.scorer.aclose()
            self.state = "stopped"

    async def _admit_loop(self, buffer: AsyncReplayBuffer, stop: threading.Event) -> None:
        source = self._prompt_source()
        generation = self.generation
        while not stop.is_set():
            cfg = self.config  # read at each admission: a pool's run may be reconfigured (`reconfigure`)
            # --- 1. a slot: fewer than max_inflight_prompts in the engine, the pusher keeping up
            while (
                len(generation.inflight) >= (slots := self.config.max_inflight_prompts)
                or len(generation.scoring) >= _SCORING_PER_SLOT * slots
                or len(self._pending) >= slots
            ):
                await self._sleep_until_woken()
                if stop.is_set():
                    return
                if cfg.reload.mode == "inflight":  # no need to wait for a slot to update the weights
                    await self._update_weights(stop)
            # --- 2. weights: apply a newer published version (drain / abort / inflight)
            await self._update_weights(stop)
            # --- 2b. evaluation of the version held, when due (weight loads wait for it)
            version = self.engine.loaded_version
            if self.evaluator is not None and self._eval_task is None and self.evaluator.due(version):
                self._eval_task = asyncio.create_task(self._evaluate(self.engine.loaded_version))
            # --- 3. pacing: wait while the buffer holds max_ahead fresh groups (dataset prompts only)
            if cfg.buffer.max_ahead is not None and self._trains_on_dataset:
                await wait_for_room(buffer, self.engine.loaded_version, cfg.retry, self.metrics, stop)
            if stop.is_set():
                return
            # --- 4. admit the next prompt (aborted ones first); at the end, wait for the last ones
            prompt = generation.next_readmitted()
            prompt = next(source, None) if prompt is None else prompt
            if prompt is None:
                if (
                    generation.idle
                    and self.gateway is None
                    and cfg.mode == "train"
                    and self.evaluator is None
                ):
                    return  # every epoch done, nothing in flight or to re-admit (gateway, evaluation go on)
                await self._sleep_until_woken()
                continue
            sampling = self.config.sampling  # the admission's (read with `_params`, after the last await):
            ids = generation.encode(prompt, sampling)  # its request keeps it, its group is stamped with it
            if ids is not None:
                generation.admit(prompt, ids, sampling, self.request_params(prompt))

    # --- weights

    async def _update_weights(self, stop: threading.Event) -> None:
        """Load the newer published version, if any, the way `reload.mode` says; observe the pause."""
        self._raise_fatal()
        if self._eval_task is not None or self._receiver is not None:
            return  # an evaluation holds its version; with transport vllm the receiver changes the weights
        # checked and read ahead in the background (`reload.prefetch`) while prompts are admitted
        record = None if self.sync is None else self.sync.ready(on_done=self._wake.set)
        if record is None:
            return
        mode, t0 = self.config.reload.mode, time.perf_counter()
        if mode == "abort":
            await self.engine.abort(list(self.generation.inflight))
        if mode == "abort" or (mode == "drain" and self.engine.adapters is None):  # adapters: no drain
            while self.generation.inflight and not stop.is_set():
                await self._sleep_until_woken()
            if stop.is_set():
                return  # the in-flight requests are cancelled on the way out; nothing to load for
        if await self.sync.load(record):
            self.metrics.reload_pause.observe(time.perf_counter() - t0)

    # --- evaluation

    @property
    def _trains_on_dataset(self) -> bool:
        return self.config.mode == "train" and self.config.dataset is not None

    async def _evaluate(self, version: int) -> None:
        """Evaluate `version` (the engine holds it; loads wait), report it; a failure is logged, not fatal."""
        assert self.evaluator is not None
        try:
            record = await self.evaluator.run(version)
            self.metrics.record_eval(record)
            passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in record.pass_at.items())
            log.info(
                "eval v%d: reward %.3f, %s over %d prompts (%.1f s)",
                version, record.reward_mean, passes, record.prompts, record.seconds,
            )  # fmt: skip
            await self._evals.add(record)
        except StorageUnavailable as e:
            log.warning("eval v%d: not recorded in Redis: %s", version, e)
        except Exception:  # an evaluation never takes the actor down: logged, the next one runs
            log.exception("eval v%d failed", version)
        finally:
            self._eval_task = None
            self._wake.set()

    # --- pushing

    def submit(self, group: TrajectoryGroup, images: Mapping[str, bytes] | None = None) -> None:
        """Hand a scored group to the pusher, observing its rewards (on the engine's loop: the loop's own
        groups and the gateway's finished ones). `images`: the encoded images it shows by sha256, where
        they are not the dataset's (a gateway episode's screenshots); they go with the group and are not
        kept after it."""
        if not self._loop_running:
            raise ActorNotRunning("the actor's loop is not running: groups cannot be pushed")
        for t in group.trajectories:
            self.metrics.reward.observe(t.reward)
        self._pending.append(group)
        if images:
            self._pending_images.update(images)
        self._push_wake.set()

    async def _push_loop(self, buffer: AsyncReplayBuffer, stop: threading.Event, closing: asyncio.Event):
        """Insert scored groups as they come; a failing insert is retried (bounded waits) with its groups
        kept, while new groups queue behind it (and hold admission back once `max_inflight_prompts` wait)."""
        while True:
            if not self._pending:
                if closing.is_set():
                    return
                self._push_wake.clear()
                await self._push_wake.wait()
                continue
            if len(self._pending) < self.config.max_inflight_prompts // 2 and not closing.is_set():
                await asyncio.sleep(_PUSH_LINGER_S)  # let a few groups gather: one round trip for them
            batch, self._pending = self._pending, []
            shown, self._pending_images = self._pending_images, {}
            self.groups_pushed += await push_groups(
                buffer, batch, self.config.retry, self.metrics, stop, ChainMap(shown, self.images)
            )
            self._wake.set()

    # --- helpers

    def _prompt_source(self) -> Iterator[Prompt]:
        """This actor's shard, epoch after epoch, reshuffled per epoch (`dataset.seed`, the epoch)."""
        d = self.config.dataset
        if d is None or self.config.mode == "eval":
            return
        for epoch in itertools.count() if d.max_epochs is None else range(d.max_epochs):
            for batch in epoch_batches(self.prompts, len(self.prompts), epoch, d.seed, d.shuffle):
                yield from batch

    async def _sleep_until_woken(self) -> None:
        """Until a request finishes, the pusher takes groups, or `_WAKE_S` passes."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):  # a bounded nap, not an error
            await asyncio.wait_for(self._wake.wait(), _WAKE_S)
        self._raise_fatal()

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _fail(self, error: BaseException) -> None:
        """A task's unexpected error (a prompt's, the receiver's): the admission loop raises the first."""
        if self._fatal is None:
            self._fatal = error
        self._wake.set()
