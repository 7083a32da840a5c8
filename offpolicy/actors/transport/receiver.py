"""The actor's side of `reload.transport: vllm`: membership heartbeats and the learner's commands.

`TransferReceiver.run()` runs beside the rollout loop on the engine's event loop. Out of a group it first
catches up from files: when the policy record names a newer file generation than the engine holds, it is
verified and loaded (engine paused in place), so an actor that starts, restarts or missed an update holds
the newest durable version before it announces itself. Then it announces the actor as a member
(weights/control.py: a TTL key refreshed every `heartbeat_s`) and executes the learner's commands from its
Redis inbox:

- `init`: join the transfer group of an epoch (vLLM's `init_weight_transfer_engine` with this actor's rank
  offset), bounded by `timeout_s`;
- `update`: pause the scheduler in place (as a file load does), receive the version, tag it on the tokens
  sampled from now on, reset the prefix cache, resume; answer with the seconds it took. A failed receive
  (the learner or a peer died, a timeout) loads the newest file generation back before the engine resumes,
  so the engine never serves half-received weights and every token's version is the one it holds; the
  actor then waits to be taken into the next group;
- `leave`: drop the group.

A command of another epoch than the one joined is answered with an error (the learner re-forms).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

from offpolicy.actors.errors import EngineError, PolicyKindMismatch, WeightLoadError
from offpolicy.actors.transport.verify import verify_folder
from offpolicy.actors.transport.weight_sync import weights_path

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.config import ActorConfig
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.weights.config import TransferConfig
    from offpolicy.weights.control import ActorControl
    from offpolicy.weights.record import AsyncPolicyStore, PolicyRecord

log = logging.getLogger(__name__)


class ReceiverMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.seconds = Histogram(
            "offpolicy_actor_transfer_seconds",
            "Seconds one weight transfer held the engine paused (receive, tag, cache reset)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r,
        )  # fmt: skip
        self.transfers = Counter(
            "offpolicy_actor_transfers_total", "Versions received by transfer", registry=r
        )
        self.failures = Counter(
            "offpolicy_actor_transfer_failures_total", "Failed transfer commands", ["op"], registry=r
        )
        self.epoch = Gauge("offpolicy_actor_transfer_epoch", "Transfer group joined (0 = none)", registry=r)


class TransferReceiver:
    """Heartbeats and command execution for one actor's engine."""

    def __init__(
        self,
        control: ActorControl,
        engine: VLLMEngine,
        store: AsyncPolicyStore,
        config: TransferConfig,
        registry: CollectorRegistry,
        verify: str = "manifest",
        weights_root: str | None = None,
    ) -> None:
        self.control, self.engine, self.store, self.config = control, engine, store, config
        self.verify = verify  # `reload.verify` for the file generations it loads
        self.weights_root = weights_root  # `reload.weights_root`: where relative `weights_uri`s resolve
        self.metrics = ReceiverMetrics(registry)
        self.epoch: int | None = None
        self.received = 0  # versions received by transfer
        self.caught_up = False  # the engine holds the newest file generation (or newer): it may announce

    @property
    def in_group(self) -> bool:
        return self.epoch is not None

    async def run(self) -> None:
        """Heartbeat and execute commands until cancelled (then leave the membership)."""
        beat = asyncio.create_task(self._heartbeat())
        try:
            while True:
                if not self.engine.alive:  # a member whose engine is gone must not be taken into a group
                    raise EngineError(self.engine.broken or "the vLLM engine died")
                if self.epoch is None and not await self._catch_up():
                    await asyncio.sleep(self.config.heartbeat_s)
                    continue
                cmd = await self.control.next_command(1.0)
                if cmd is not None:
                    await self.handle(cmd)
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await beat
            with contextlib.suppress(Exception):
                await self.control.leave()

    async def _heartbeat(self) -> None:
        workers = self.engine.config.tensor_parallel_size
        while True:
            if self.caught_up and self.engine.alive:  # a dead engine stops beating: its membership lapses
                try:
                    await self.control.heartbeat(
                        workers, self.engine.loaded_version, 3 * self.config.heartbeat_s
                    )
                except Exception as e:  # translated: Redis away; the membership lapses and is renewed later
                    log.warning("transfer heartbeat failed: %s", e)
            await asyncio.sleep(self.config.heartbeat_s)

    async def handle(self, cmd: dict[str, Any]) -> None:
        """Execute one command and answer it."""
        op, token, t0 = cmd.get("op"), cmd.get("token", ""), time.perf_counter()
        try:
            if op == "leave":
                if cmd.get("epoch") == self.epoch:
                    await self._leave()
                return
            if op == "init":
                await self._leave()
                info = dict(cmd["init_info"], rank_offset=cmd["rank_offsets"][self.control.actor_id])
                await self.engine.join_transfer(info, self.config.timeout_s)
                self.epoch = int(cmd["epoch"])
                self.metrics.epoch.set(self.epoch)
            elif op == "update":
                if cmd.get("epoch") != self.epoch:
                    raise WeightLoadError(
                        cmd.get("version", -1), "transfer", f"not in epoch {cmd.get('epoch')}"
                    )
                await self._receive(cmd["update_info"], int(cmd["version"]))
            else:
                raise WeightLoadError(-1, "transfer", f"unknown command {op!r}")
        except WeightLoadError as e:
            self.metrics.failures.labels(str(op)).inc()
            log.error("transfer %s failed: %s; generating with v%d", op, e, self.engine.loaded_version)
            await self.control.answer(token, False, str(e), time.perf_counter() - t0)
            return
        await self.control.answer(token, True, "", time.perf_counter() - t0)

    async def _receive(self, update_info: Any, version: int) -> None:
        t0 = time.perf_counter()
        async with self.engine.paused():
            try:
                await self.engine.receive_weights(update_info, version, self.config.timeout_s)
            except WeightLoadError as e:
                await self._leave()
                try:  # before the engine resumes: never serve half-received weights
                    await self._recover()
                except Exception as r:  # translated: the engine holds unknown weights; it must not resume
                    self.engine.broken = (
                        f"transfer of v{version} failed ({e}) and no file generation loaded: {r}"
                    )
                    raise EngineError(self.engine.broken) from r
                raise
        self.received += 1
        self.metrics.transfers.inc()
        self.metrics.seconds.observe(time.perf_counter() - t0)
        log.info("received policy v%d in %.3f s", version, time.perf_counter() - t0)

    async def _catch_up(self) -> bool:
        """Out of a group: load the newest file generation when it is newer than what the engine holds.
        True when the engine is up to date with the files (it may announce itself); False after a failure
        (logged, counted; tried again later)."""
        try:
            record = await self.store.read()
            if record is not None and record.version > self.engine.loaded_version:
                self.caught_up = False
                async with self.engine.paused():
                    await self._load(record)
        except Exception as e:  # translated: Redis away or a bad folder; the actor keeps its version
            self.caught_up = False
            self.metrics.failures.labels("catch_up").inc()
            log.error("catching up from files failed: %s; generating with v%d", e, self.engine.loaded_version)
            return False
        self.caught_up = True
        return True

    async def _load(self, record: PolicyRecord) -> None:
        if record.kind != "full":  # a LoRA learner's adapter: served by engine.lora actors, over files only
            raise PolicyKindMismatch(record.version, record.kind, "full")
        folder = weights_path(record.weights_uri, self.weights_root)
        await asyncio.to_thread(verify_folder, folder, record.sha256, record.version, self.verify)
        await self.engine.reload_weights(str(folder), record.version, self.config.timeout_s)
        log.info("loaded the file generation v%d", record.version)

    async def _recover(self) -> None:
        """Load the newest file generation (inside the pause); raises when there is none or it fails."""
        record = await self.store.read()
        if record is None:
            raise WeightLoadError(self.engine.loaded_version, "restore", "no file generation to recover from")
        await self.engine.discard_partial_loads(self.config.timeout_s)  # else modules half received mix in
        await self._load(record)
        log.warning("recovered from the file generation v%d after a failed transfer", record.version)

    async def _leave(self) -> None:
        if self.epoch is not None:
            self.epoch = None
            self.metrics.epoch.set(0)
            await self.engine.leave_transfer()


def start_receiver(
    config: ActorConfig,
    actor_id: str,
    engine: VLLMEngine,
    registry: CollectorRegistry,
    store: AsyncPolicyStore,
    on_failure: Callable[[BaseException], None],
) -> asyncio.Task | None:
    """`reload.transport: vllm`: run a `TransferReceiver` for the actor `actor_id` on the running loop; its
    failure (the engine's weights unknown) goes to `on_failure` (the actor's fatal error). None with
    `transport: files`."""
    if config.reload.transport != "vllm":
        return None
    from offpolicy.weights.control import ActorControl

    control = ActorControl(config.redis_url, config.run_id, actor_id, config.buffer.storage_timeout_s)
    receiver = TransferReceiver(
        control,
        engine,
        store,
        config.reload.transfer,
        registry,
        config.reload.verify,
        config.reload.weights_root,
    )

    async def run() -> None:
        try:
            await receiver.run()
        finally:
            await control.close()

    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            on_failure(task.exception())

    task = asyncio.get_running_loop().create_task(run())
    task.add_done_callback(done)
    return task
