"""The trainer: one `Learner` owns the state, the control API, the step and the loop around it.

Reads top to bottom like a CleanRL file: `Learner.__init__` (model, optimizer, buffer, resume), the
control API other threads call, `run` (the loop), then `step()` in the order of spec §5.1. The training of
a step is `rl.train_on`, called with a frozen `StepContext`; it returns the step's metrics and optimizer
steps, and the trainer alone changes its own state (version, step count):

    sample k groups (consumer_version = version) → collate → [decoupled] pi_old once, correction, the
    RS mask replaces the response mask → advantages → ppo_epochs × mini-batches (groups) × micro-batches
    (rows, gradient accumulation) → clip → AdamW step (version += 1) → publish / checkpoint.

In bypass mode pi_old := pi_rollout and the correction runs per micro-batch inside the loss. Config
changes land only between steps; `checkpoint()` from another thread waits for the running step to end.

The leader's side of the buffer (lease, screen, dynamic sampling, acks with priorities) is `Intake`
(learner/intake.py); the loop around the step, which waits out an empty buffer, Redis outages and a
checkpoint cap, is learner/loop.py. Any other error propagates (the loop is dead).

On N ranks (torchrun; learner/distributed/) the rank-0 `Learner` (leader) samples, screens and sends each
step boundary's `Command` to the others (followers), which run `run_follower()`; from there every rank
runs the same `_execute`: the same config, the same batch, its own share of it, FSDP2. While paused or
waiting the leader keeps sending heartbeats, so its followers hear of a config change or a checkpoint
request.

`Learner` holds its parts as objects that own their state and are given what they use when built: the
config and its version (`ConfigSwitch`, learner/reconfigure.py), what makes updates durable (`Durability`,
learner/durability.py), the followers' loop (`run_follower`, learner/distributed/commands.py, given the
learner's `_follow` to run each command), the intake, the delivery of acks and the background writes.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from offpolicy.buffer.codec import decode_group, encode_group
from offpolicy.buffer.evaluations import EvalStore
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.build import Built, Trainables, build_models
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.resume import ResumedConfig, resumed_config
from offpolicy.learner.control import StalenessControl
from offpolicy.learner.delivery import Delivery
from offpolicy.learner.distributed import (
    Command,
    LeaderChannel,
    Ranks,
    barrier,
    broadcast_command,
    current,
    nccl_net,
    run_follower,
)
from offpolicy.learner.durability import Durability
from offpolicy.learner.intake import Intake
from offpolicy.learner.loop import run_loop
from offpolicy.learner.metrics import LearnerMetrics, timed
from offpolicy.learner.model import checkpoint_dtype, load_tokenizer, moe
from offpolicy.learner.model.precision import Precision
from offpolicy.learner.model.reference import check_teacher_tokenizer
from offpolicy.learner.model.vision import image_problem, is_vision_language, load_image_processor
from offpolicy.learner.persist import BackgroundWriter, Persistence
from offpolicy.learner.plan.auto import Settings
from offpolicy.learner.reconfigure import ConfigApplied, ConfigSwitch
from offpolicy.learner.rl import ModelLimits, StepContext, StepResult, train_on
from offpolicy.learner.tracking import StepLog, build_tracker
from offpolicy.learner.transport.publisher import make_publisher
from offpolicy.weights.record import PolicyStore

log = logging.getLogger(__name__)

# --- the learner


class Learner:
    """One training process: holds model, optimizer, buffer and policy store; `run` loops `step`.

    `ranks`: this process's place among N (default `distributed.current()`: the only one without
    torchrun). Followers (rank > 0) hold no buffer, policy store or delivery: they train on what the
    leader sends, in `run_follower()`."""

    def __init__(
        self,
        config: LearnerConfig,
        registry: CollectorRegistry | None = None,
        on_config_applied: ConfigApplied | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        ranks = ranks if ranks is not None else current()  # torchrun: the group joined at start
        self.ranks = ranks
        self.resumed: ResumedConfig | None = None
        """Set when the learner resumed a checkpoint: the config it reapplied (the service's history)."""
        self.metrics = LearnerMetrics(registry if registry is not None else CollectorRegistry())
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        # --- model (master weights in the precision's dtype), optimizer, schedule, critic; tokenizer
        check_teacher_tokenizer(config)  # before any weight loads
        self.built: Built = build_models(config, ranks)
        """Where and how the learner trains, and its models (read through the properties below)."""
        self.metrics.start_way.labels(way=self.built.start_way).set(1)
        if ranks.distributed and (config.device or "").startswith("cuda") and nccl_net.spans_nodes():
            self.metrics.nccl_net.labels(net=nccl_net.network().net).set(1)
        self.tokenizer = load_tokenizer(config.model_path)
        replayed = config.moe.routing_replay == "rollout"  # groups without routed experts refused
        vision = is_vision_language(self.model.config)
        budget = config.image_pixels.processor_kwargs()
        self.image_processor = load_image_processor(config.model_path, **budget) if vision else None
        self.limits = ModelLimits(
            vocab_size=self.model.get_input_embeddings().num_embeddings,
            max_positions=self.model.config.get_text_config().max_position_embeddings,
            routed=moe.replay_shape(self.built.parts.policy) if replayed else None,
            images=vision,
        )
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # --- experiment trackers (rank 0): the JSONL file, TensorBoard, W&B, MLflow as configured
        self.tracker = build_tracker(config, self.metrics.tracking_errors, self.tokenizer, ranks.is_leader)
        # --- buffer and policy record (the leader's alone)
        leader = ranks.is_leader
        self.buffer = (
            ReplayBuffer(config.redis_url, config.run_id, config.buffer, registry, follow_learner=False)
            if leader
            else None
        )
        self.store = PolicyStore(config.redis_url, config.run_id) if leader else None
        evals = EvalStore(config.redis_url, config.run_id) if leader else None
        self.step_log = StepLog(self.tracker, self.metrics, evals)  # each applied step's line and record
        self.channel = LeaderChannel(ranks) if ranks.distributed and leader else None  # N ranks: rank 0
        # --- the config and its version: one owner (the API's thread submits, the loop takes)
        self.configs = ConfigSwitch(
            config, ranks, self.trainables, self.metrics, self.tracker, self.buffer, self.channel,
            on_config_applied,
        )  # fmt: skip
        self.control = StalenessControl(self.metrics)  # `control.mode: auto` sets the staleness bound
        # --- state shared with the control thread
        self.version = 0  # optimizer steps taken = policy version
        self.step_count = 0  # learner steps taken
        self.state = "starting"
        self.retrying: str | None = None  # why `run` is retrying transient trouble now; None when it is not
        self._table_published: object = None  # the buffer config whose table fields producers have
        self._step_lock = threading.Lock()  # held while a step trains, publishes or checkpoints
        self._running = threading.Event()
        self._running.set()
        # --- acks, durability, published weights and checkpoints (off the critical path)
        self.delivery = (
            Delivery(self.buffer, config.run_id, config.delivery_mode, config.lease_s, self.metrics)
            if self.buffer is not None
            else None
        )
        self.durability = Durability(ranks, self.metrics, self.delivery)
        dtype = checkpoint_dtype(config.model_path)  # published weights = masters cast to this
        self.persist = Persistence(
            config, self.model, self.tokenizer, dtype, self.store, self.metrics, self.durability.on_durable,
            ranks,
        )  # fmt: skip
        self.publisher = make_publisher(
            config, self.persist, self.model, dtype, self.metrics.registry, ranks, self.metrics.transfer_stuck
        )
        self.intake = (  # lease, screen, dynamic sampling, acks with priorities: learner/intake.py
            Intake(self.buffer, self.delivery, self.metrics, self.limits, self._image_check())
            if self.buffer is not None and self.delivery is not None
            else None
        )
        self._start()
        self.state = "running"

    def _start(self) -> None:
        """Resume from the newest checkpoint (if any), settle its leases, and publish the weights the actors
        start from unless the policy record already names them (every rank joins: a collective)."""
        ranks = self.ranks
        if ranks.distributed:
            barrier(ranks)  # the leader has removed leftover partial writes
        meta = self.persist.restore_latest(self.trainables)
        if meta is not None:
            self._resumed(meta)
        self.tracker.log_config(
            self.config, "initial" if meta is None else "resume", self.configs.version, self.step_count
        )
        if self.delivery is not None:
            held = meta or {}  # the resumed checkpoint's leases, acked with their priorities
            self.delivery.recover(held.get("lease_ids", []), held.get("lease_priorities"))
        need = self.persist.needs_publish(self.version) if ranks.is_leader else False
        command = Command("publish" if need else "noop") if ranks.is_leader else None
        if broadcast_command(ranks, command).op == "publish":
            self._publish()  # written by the background writer while the first steps train

    def _resumed(self, meta: dict[str, Any]) -> None:
        """Take the resumed checkpoint's counters and config. The version is always that of the weights we
        hold: versions published after that checkpoint are superseded (`_start` re-publishes ours)."""
        self.version, self.step_count = int(meta["version"]), int(meta["step"])
        # the checkpoint's config or the file's (checkpoint.resume_config); the optimizer and scheduler
        # restored from the checkpoint are re-aligned with it (learning rate and schedule included)
        self.resumed = resumed_config(self.config, meta)
        self.configs.resume(self.resumed.config, self.step_count)
        self.durability.resumed_at(self.step_count)
        record = self.store.read() if self.store is not None else None
        if record is not None and record.version > self.version:
            log.warning(
                "published v%d is newer than checkpoint v%d: its weights are lost; re-publishing v%d",
                record.version, self.version, self.version,
            )  # fmt: skip

    # --- what the build made (read-only views of `built`)

    @property
    def config(self) -> LearnerConfig:
        """The config the learner trains with now (`configs` owns it; it changes at step boundaries)."""
        return self.configs.config

    @property
    def config_version(self) -> int:
        return self.configs.version

    @property
    def config_applied_at_step(self) -> int:
        return self.configs.applied_at_step

    @property
    def trainables(self) -> Trainables:
        """The policy, its optimizer and schedule, the critic: what a step trains and a checkpoint saves."""
        return self.built.parts

    @property
    def model(self) -> torch.nn.Module:
        return self.built.parts.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.built.parts.optimizer

    @property
    def device(self) -> torch.device:
        return self.built.device

    @property
    def precision(self) -> Precision:
        return self.built.precision

    @property
    def settings(self) -> Settings | None:
        """The memory plan's choices (`auto` budgets resolved)."""
        return self.built.settings

    @property
    def reference(self) -> torch.nn.Module | None:
        return self.built.reference

    @property
    def teacher(self) -> torch.nn.Module | None:
        """On-policy distillation's frozen teacher; None without one."""
        return self.built.teacher

    # --- control (called from other threads)

    def apply_config(self, new_config: LearnerConfig, config_version: int) -> None:
        """Queue `new_config` as config `config_version` (numbered by the caller: the service's
        `ConfigControl`); it takes effect at the next step boundary. Frozen fields raise at once.

        When it takes effect, `status()` shows `config_version` and `config_applied_at_step`, the gauge
        `offpolicy_learner_config_version` moves, and `on_config_applied(version, step)` is called."""
        self.configs.submit(new_config, config_version)

    def pause(self) -> None:
        """Stop after the running step (nothing is torn); `resume()` continues."""
        self._running.clear()
        self.metrics.paused.set(1)

    def resume(self) -> None:
        self._running.set()
        self.metrics.paused.set(0)

    def wait_unpaused(self, timeout_s: float) -> bool:
        """Whether the learner is not paused, waiting up to `timeout_s` for a `resume()`."""
        return self._running.wait(timeout_s)

    @property
    def writer(self) -> BackgroundWriter:
        """The background writer (`flush()` waits until every queued publish and checkpoint is durable)."""
        return self.persist.writer

    def checkpoint(self) -> tuple[Path, int]:
        """Checkpoint now (after the running step, if any) and wait until it is durable; training goes on
        meanwhile. Returns (folder, version). On N ranks the loop takes it at its next step boundary (every
        rank checkpoints its shards) and this waits for that."""
        if self.ranks.distributed:
            if self.config.checkpoint_path is None:
                self.persist.checkpoint(self.trainables, 0, 0, {})  # raises CheckpointsDisabled
            assert self.channel is not None, "checkpoint() is the leader's"
            return self.channel.request_checkpoint()
        with self._step_lock:
            path, version = self._checkpoint(), self.version
        self.persist.writer.flush(kind="checkpoint")  # a full disk: WriteFailed, the write retried
        return path, version

    def undurable_steps(self) -> int:
        """Learner steps not covered by a durable checkpoint (0 without checkpoints: nothing to cover)."""
        return self.durability.undurable_steps(self.config, self.step_count)

    def status(self) -> dict[str, Any]:
        """State, version, step, tokens/s, buffer stats and the last step's key metrics (JSON-safe)."""
        idle = self.state in ("running", "waiting_for_data", "waiting_for_redis", "waiting_for_checkpoint")
        state = "paused" if not self._running.is_set() and idle else self.state
        built = self.built
        return {
            "state": state,
            "world_size": self.ranks.world_size,
            "policy_version": self.version,
            "step": self.step_count,
            "versions_per_step": self.config.optimizer_steps_per_step,
            "config_version": self.configs.version,
            "config_applied_at_step": self.configs.applied_at_step,
            "tokens_per_s": self.step_log.tokens_per_s,
            "leases_unacked": len(self.delivery.unacked) if self.delivery is not None else 0,
            "buffer": self.buffer.stats() if self.buffer is not None else None,
            "last_step": dict(self.metrics.last),
            "memory_plan": built.memory_plan.as_dict(),
            "settings": built.settings.as_dict() if built.settings is not None else None,
            "grad_sync": built.grad_sync,
            "start_way": built.start_way,
            "host_memory_plan": built.host_plan,
            "groups_dropped": dict(self.intake.groups_dropped) if self.intake is not None else {},
            "writes_failing": {kind: dict(t) for kind, t in dict(self.persist.troubles).items()},
            "transfer": self.publisher.status(),
            "intake_stopped": self.retrying if self.state == "waiting_for_checkpoint" else None,
            "undurable_steps": self.undurable_steps(),
            "control": {"mode": self.configs.given.control.mode}
            | self.control.status(self.configs.given.buffer.max_staleness),
        }

    def run(self, stop_event: threading.Event) -> None:
        """Loop `step()` until `stop_event` is set or `max_steps` is reached; waits while paused.

        No data yet, or Redis unreachable: waited out; any other error propagates (the loop is dead)."""
        try:
            run_loop(self, stop_event)
        finally:
            self._stop_followers()

    # --- one learner step

    def step(self) -> dict[str, float]:
        """Sample, train, publish, checkpoint: one learner step. Returns its metrics."""
        assert self.intake is not None and self.buffer is not None and self.delivery is not None, (
            "followers run run_follower(), not step()"
        )
        self.persist.writer.raise_if_failed()  # a bug's failed write ends the loop (a full disk: retried)
        self.persist.poll()
        self.delivery.ack_durable()  # leases of checkpoints that became durable since the last step
        self.configs.take(self.step_count)
        self.control.decide(self.configs, self.step_count, self.buffer.stats)  # the bound for this step
        cfg, phases = self.config, {}
        self.durability.check(cfg, self.step_count, self.persist, self._checkpoint_now)
        if self._table_published != cfg.buffer:  # at start and after a `buffer` change: producers follow
            self.buffer.publish_table()
            self._table_published = cfg.buffer
        taken = self.intake.take(cfg, self.version, phases)
        self.state = "running"
        groups = taken.groups
        if not groups:  # nothing trainable in this sample: no update, the loop samples again
            self.heartbeat()
            return {"groups_dropped": float(taken.dropped)}
        self.control.fed()
        images = taken.images  # read and checked by the intake
        command = self._command("step", groups, images)
        self.intake.prefetch_after(
            cfg, self.version, len(groups), self.step_count, self.device.type == "cuda"
        )
        applied: dict[str, float] = {}  # the update's metrics, once it is applied
        sifted = taken.metrics  # dynamic sampling's
        with self._step_lock:
            leases = [taken.lease_of[g.group_id] for g in groups]

            def trained(result: StepResult) -> None:  # after the update: the version it made
                self.intake.trained(self.config, self.version, leases, groups, result)

            try:
                self._execute(command, groups, phases, trained, applied, images)
            except BaseException:
                if applied:  # applied, then an ack, publish or background write failed: it still counts
                    timing = self.control.trained(applied, len(groups))
                    self._record(applied | sifted | timing, phases, groups)
                raise
        timing = self.control.trained(applied, len(groups))  # the controller's record of the step
        return self._record(applied | sifted | timing, phases, groups)

    def _record(self, metrics: dict[str, float], phases: dict[str, float], groups: list) -> dict[str, float]:
        """The metrics line (trackers) and Prometheus record of a step whose update was applied."""
        counters = {
            "step": float(self.step_count),
            "config_version": float(self.configs.version),
            "published_lag": float(self.version - (self.persist.published_version or 0)),
        }
        return self.step_log.record(metrics, phases, groups, counters)

    def _execute(
        self,
        command: Command,
        groups: list,
        phases: dict[str, float],
        on_trained: Callable[[StepResult], None] | None = None,
        applied: dict[str, float] | None = None,
        images: Mapping[str, bytes] | None = None,
    ) -> dict[str, float]:
        """Every rank, same step boundary: train on `groups` (op `step`; then `on_trained(result)`: the
        leader marks their leases, which a checkpoint of this step then holds), publish, checkpoint when due.
        `applied` gets the step's metrics as soon as the update is applied, before anything that may
        still fail (the ack, the publish, a background write's error re-raised)."""
        cfg, metrics = self.config, {}
        if command.op == "step":
            result = train_on(self.step_context(), groups, phases, images)
            self.version += result.optimizer_steps  # the policy version counts optimizer steps
            metrics = result.metrics
            self.step_count += 1  # applied: it counts, whatever fails after it
            if applied is not None:
                applied.update(metrics)
            if on_trained is not None:
                on_trained(result)
            if self.step_count % cfg.publish.publish_every == 0:
                with timed(phases, "publish"):
                    self._publish()
        every = cfg.checkpoint.checkpoint_every
        due = (
            command.op == "step"
            and cfg.checkpoint_path is not None
            and every
            and self.step_count % every == 0
        )
        if due or command.checkpoint:
            with timed(phases, "checkpoint"):
                path = self._checkpoint()
            if command.checkpoint:  # asked for through checkpoint(): durable before the caller hears back
                self.persist.flush()
                if self.channel is not None:
                    self.channel.checkpoint_taken(path, self.version)
        return metrics

    def _publish(self) -> None:
        """Publish the current weights (N ranks: every rank joins the gather to rank 0's host memory)."""
        self.publisher.publish(self.version, self.built.publish_keys if self.ranks.distributed else None)

    def _checkpoint(self) -> Path:
        """Snapshot a checkpoint and queue its write; return the folder it will have."""
        position, leases, priorities = {}, [], {}
        if self.buffer is not None and self.delivery is not None:  # the leader's (its meta is the one kept)
            stats = self.buffer.stats()
            position = {"inserted_total": stats.inserted_total, "sampled_total": stats.sampled_total}
            leases, priorities = self.delivery.checkpointed(self.version)
        self.publisher.at_checkpoint(
            self.version, self.built.publish_keys if self.ranks.distributed else None
        )
        self.durability.queued(self.version, self.step_count)
        return self.persist.checkpoint(
            self.trainables, self.version, self.step_count, position, leases, self.configs.version,
            lease_priorities=priorities, config=self.configs.given,
        )  # fmt: skip

    def _checkpoint_now(self) -> None:
        """A checkpoint between steps (the durability cap's, when none waits for a retry)."""
        with self._step_lock:
            self._checkpoint()

    # --- N ranks: the leader's commands, the followers' loop

    def _command(self, op: str, groups: list, images: Mapping[str, bytes] | None = None) -> Command:
        """Leader: tell every rank what this step boundary does (the groups, the images they show), with the
        config the leader applied since the last command (a no-op on one process)."""
        if self.channel is None:
            return Command(op)
        frames = [encode_group(g, self.config.buffer.limits) for g in groups]
        return self.channel.send(op, frames, dict(images or {}))

    def _image_check(self) -> Callable[[Any, Mapping[str, bytes]], str | None] | None:
        """A vision-language policy's check of a group's images (model/vision.py `image_problem`)."""
        if self.image_processor is None:
            return None
        processor, token = self.image_processor, self.model.config.image_token_id
        return lambda group, blobs: image_problem(processor, token, group, blobs)

    def heartbeat(self) -> None:
        """Leader with nothing to train: N ranks hear from it (a config change, a checkpoint request)."""
        if self.channel is None:
            return
        self.configs.take(self.step_count)
        self.persist.poll()
        command = self._command("noop", [])
        if command.checkpoint:
            with self._step_lock:
                self._execute(command, [], {})

    def run_follower(self, stop_event: threading.Event | None = None) -> None:
        """Follower: run the leader's commands until it sends `stop` (distributed/commands.py)."""
        run_follower(self.ranks, self._follow, stop_event)

    def _follow(self, command: Command) -> None:
        """Follower: one leader command: the config it carries, then the same `_execute` as the leader."""
        if command.config is not None:
            new = LearnerConfig.model_validate_json(command.config)
            self.configs.receive(new, command.config_version, self.step_count)
        limits = self.config.buffer.limits
        self.persist.poll()
        self._execute(command, [decode_group(f, limits) for f in command.groups], {}, images=command.images)
        if command.op == "step":
            self.state = "running"

    def _stop_followers(self) -> None:
        """Leader: send `stop` once (the followers return from `run_follower`)."""
        if self.channel is not None:
            self.channel.stop()

    # --- plumbing

    def step_context(self) -> StepContext:
        """What the next step trains with (frozen: `train_on` reads it, the learner keeps its state)."""
        built = self.built
        return StepContext(
            config=built.settings.apply(self.config) if built.settings is not None else self.config,
            device=built.device,
            precision=built.precision,
            ranks=self.ranks,
            pad_id=self.pad_id,
            version=self.version,
            step_count=self.step_count,
            trainables=built.parts,
            reference=built.reference,
            teacher=built.teacher,
            before_update=self.persist.fence,
            metrics=self.metrics if self.ranks.is_leader else None,
            grad_sync=built.grad_sync,
            image_processor=self.image_processor,
        )

    def close(self) -> None:
        """Finish the background writes and acknowledge what they made durable, give back the leases whose
        updates are in no durable checkpoint, then close the Redis connections (leader)."""
        self._stop_followers()
        self.persist.close()  # N ranks: the last version gathered for a transport is sent here
        self.publisher.close()
        self.tracker.close()
        if self.delivery is not None and self.buffer is not None and self.store is not None:
            if self.intake is not None:
                self.intake.close()  # a lease taken ahead goes back untrained
            self.delivery.ack_durable()
            self.delivery.close(release=True)
            self.buffer.close()
            self.store.close()
