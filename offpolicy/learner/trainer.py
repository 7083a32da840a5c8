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
step boundary's `Command` to the others (followers), which run `follow()`; from there every rank runs the
same `_execute`: the same config, the same batch, its own share of it, FSDP2. While paused or waiting the
leader keeps sending heartbeats, so its followers hear of a config change or a checkpoint request.

Three mixins hold the rest of `Learner`: config changes at step boundaries (learner/reconfigure.py), its
checkpoints, durability cap and resume (learner/durability.py), and the leader's commands and the
followers' loop (learner/distributed/follow.py).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from offpolicy.buffer.evaluations import EvalStore
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.build import Trainables, build_models
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.resume import ResumedConfig
from offpolicy.learner.delivery import Delivery
from offpolicy.learner.distributed import (
    Command,
    LeaderChannel,
    Ranks,
    barrier,
    broadcast_command,
    current,
)
from offpolicy.learner.distributed.follow import CommandLoop
from offpolicy.learner.durability import Durability
from offpolicy.learner.intake import Intake
from offpolicy.learner.loop import run_loop
from offpolicy.learner.metrics import LearnerMetrics, timed
from offpolicy.learner.model import checkpoint_dtype, load_tokenizer
from offpolicy.learner.model.reference import check_teacher_tokenizer
from offpolicy.learner.persist import BackgroundWriter, Persistence
from offpolicy.learner.reconfigure import Reconfiguring
from offpolicy.learner.rl import ModelLimits, StepContext, StepResult, train_on
from offpolicy.learner.tracking import StepLog, build_tracker
from offpolicy.learner.transport.publisher import make_publisher
from offpolicy.weights.record import PolicyStore

log = logging.getLogger(__name__)

# --- the learner


ConfigApplied = Callable[[int, int], None]
"""`on_config_applied(config_version, step)`: called from the loop's thread at the step boundary where a
config took effect; `step` = learner steps completed before it (step + 1 is the first to run with it)."""


class Learner(Reconfiguring, Durability, CommandLoop):
    """One training process: holds model, optimizer, buffer and policy store; `run` loops `step`.

    `ranks`: this process's place among N (default `distributed.current()`: the only one without
    torchrun). Followers (rank > 0) hold no buffer, policy store or delivery: they train on what the
    leader sends, in `follow()`."""

    def __init__(
        self,
        config: LearnerConfig,
        registry: CollectorRegistry | None = None,
        on_config_applied: ConfigApplied | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        ranks = ranks if ranks is not None else current()  # torchrun: the group joined at start
        self.config, self.ranks = config, ranks
        self.config_version = 0
        self.config_applied_at_step = 0
        self.resumed: ResumedConfig | None = None
        """Set when the learner resumed a checkpoint: the config it reapplied (the service's history)."""
        self._on_config_applied = on_config_applied
        self.metrics = LearnerMetrics(registry if registry is not None else CollectorRegistry())
        self.metrics.record_config(0, config)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        # --- model (master weights in the precision's dtype), optimizer, schedule, critic; tokenizer
        check_teacher_tokenizer(config)  # before any weight loads
        built = build_models(config, ranks)
        self.device, self.precision, self.memory_plan = built.device, built.precision, built.memory_plan
        self.settings = built.settings  # the memory plan's choices (`auto` budgets resolved)
        self.reference, self._publish_keys = built.reference, built.publish_keys
        self.teacher = built.teacher  # on-policy distillation's frozen teacher; None without one
        self.startup_host_bytes, self.startup_host_exact = built.startup_host_bytes, built.startup_host_exact
        self.grad_sync, self.start_way, self.host_plan = built.grad_sync, built.start_way, built.host_plan
        self.metrics.start_way.labels(way=built.start_way).set(1)
        parts = built.parts
        self.model, self.policy = parts.model, parts.policy
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.critic, self.critic_optimizer = parts.critic, parts.critic_optimizer
        self.tokenizer = load_tokenizer(config.model_path)
        self.limits = ModelLimits(
            vocab_size=self.model.get_input_embeddings().num_embeddings,
            max_positions=self.model.config.max_position_embeddings,
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
        # --- state shared with the control thread
        self.version = 0  # optimizer steps taken = policy version
        self.step_count = 0  # learner steps taken
        self.state = "starting"
        self.retrying: str | None = None  # why `run` is retrying transient trouble now; None when it is not
        self._pending: tuple[LearnerConfig, int] | None = None
        self._table_published: object = None  # the buffer config whose table fields producers have
        self._lock = threading.Lock()  # guards _pending
        self._step_lock = threading.Lock()  # held while a step trains, publishes or checkpoints
        self._running = threading.Event()
        self._running.set()
        self.durable_step = 0  # learner steps covered by the newest durable checkpoint
        self._checkpoint_steps: dict[int, int] = {}  # checkpoint version queued -> its step count
        self.channel = LeaderChannel(ranks) if ranks.distributed and leader else None  # N ranks: rank 0
        # --- published weights and checkpoints (off the critical path); resume, then publish what we hold
        self.persist = Persistence(
            config,
            self.model,
            self.tokenizer,
            checkpoint_dtype(config.model_path),  # published weights = masters cast to this
            self.store,
            self.metrics,
            self._on_durable,
            ranks,
        )
        self.publisher = make_publisher(
            config,
            self.persist,
            self.model,
            checkpoint_dtype(config.model_path),
            self.metrics.registry,
            ranks,
        )
        self.delivery = (
            Delivery(self.buffer, config.run_id, config.delivery_mode, config.lease_s, self.metrics)
            if self.buffer is not None
            else None
        )
        self.intake = (  # lease, screen, dynamic sampling, acks with priorities: learner/intake.py
            Intake(self.buffer, self.delivery, self.metrics, self.limits)
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
        meta = self.persist.restore_latest(self.trainables())
        if meta is not None:
            self._resumed(meta)
            self.durable_step = self.step_count
        self.tracker.log_config(
            self.config, "initial" if meta is None else "resume", self.config_version, self.step_count
        )
        if self.delivery is not None:
            held = meta or {}  # the resumed checkpoint's leases, acked with their priorities
            self.delivery.recover(held.get("lease_ids", []), held.get("lease_priorities"))
        need = self.persist.needs_publish(self.version) if ranks.is_leader else False
        command = Command("publish" if need else "noop") if ranks.is_leader else None
        if broadcast_command(ranks, command).op == "publish":
            self._publish()  # written by the background writer while the first steps train

    # --- control (called from other threads)

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

    def status(self) -> dict[str, Any]:
        """State, version, step, tokens/s, buffer stats and the last step's key metrics (JSON-safe)."""
        idle = self.state in ("running", "waiting_for_data", "waiting_for_redis", "waiting_for_checkpoint")
        state = "paused" if not self._running.is_set() and idle else self.state
        return {
            "state": state,
            "world_size": self.ranks.world_size,
            "policy_version": self.version,
            "step": self.step_count,
            "config_version": self.config_version,
            "config_applied_at_step": self.config_applied_at_step,
            "tokens_per_s": self.step_log.tokens_per_s,
            "leases_unacked": len(self.delivery.unacked) if self.delivery is not None else 0,
            "buffer": self.buffer.stats() if self.buffer is not None else None,
            "last_step": dict(self.metrics.last),
            "memory_plan": self.memory_plan.as_dict(),
            "settings": self.settings.as_dict() if self.settings is not None else None,
            "grad_sync": self.grad_sync,
            "start_way": self.start_way,
            "host_memory_plan": self.host_plan,
            "groups_dropped": dict(self.intake.groups_dropped) if self.intake is not None else {},
            "writes_failing": {kind: dict(t) for kind, t in dict(self.persist.troubles).items()},
            "intake_stopped": self.retrying if self.state == "waiting_for_checkpoint" else None,
            "undurable_steps": self.undurable_steps(),
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
            "followers run follow(), not step()"
        )
        self.persist.writer.raise_if_failed()  # a bug's failed write ends the loop (a full disk: retried)
        self.persist.poll()
        self.delivery.ack_durable()  # leases of checkpoints that became durable since the last step
        self._apply_pending()
        cfg, phases = self.config, {}
        self._check_durability()
        if self._table_published != cfg.buffer:  # at start and after a `buffer` change: producers follow
            self.buffer.publish_table()
            self._table_published = cfg.buffer
        taken = self.intake.take(cfg, self.version, phases)
        self.state = "running"
        groups = taken.groups
        if not groups:  # nothing trainable in this sample: no update, the loop samples again
            self.heartbeat()
            return {"groups_dropped": float(taken.dropped)}
        command = self._command("step", groups)
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
                self._execute(command, groups, phases, trained, applied)
            except BaseException:
                if applied:  # applied, then an ack, publish or background write failed: it still counts
                    self._record(applied | sifted, phases, groups)
                raise
        return self._record(applied | sifted, phases, groups)

    def _record(self, metrics: dict[str, float], phases: dict[str, float], groups: list) -> dict[str, float]:
        """The metrics line (trackers) and Prometheus record of a step whose update was applied."""
        counters = {
            "step": float(self.step_count),
            "config_version": float(self.config_version),
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
    ) -> dict[str, float]:
        """Every rank, same step boundary: train on `groups` (op `step`; then `on_trained(result)`: the
        leader marks their leases, which a checkpoint of this step then holds), publish, checkpoint when due.
        `applied` gets the step's metrics as soon as the update is applied, before anything that may
        still fail (the ack, the publish, a background write's error re-raised)."""
        cfg, metrics = self.config, {}
        if command.op == "step":
            result = train_on(self.step_context(), groups, phases)
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
        self.publisher.publish(self.version, self._publish_keys if self.ranks.distributed else None)

    # --- plumbing

    def trainables(self) -> Trainables:
        return Trainables(
            self.model, self.optimizer, self.scheduler, self.critic, self.critic_optimizer, self.policy
        )

    def step_context(self) -> StepContext:
        """What the next step trains with (frozen: `train_on` reads it, the learner keeps its state)."""
        return StepContext(
            config=self.settings.apply(self.config) if self.settings is not None else self.config,
            device=self.device,
            precision=self.precision,
            ranks=self.ranks,
            pad_id=self.pad_id,
            version=self.version,
            step_count=self.step_count,
            trainables=self.trainables(),
            reference=self.reference,
            teacher=self.teacher,
            before_update=self.persist.fence,
            metrics=self.metrics if self.ranks.is_leader else None,
            grad_sync=self.grad_sync,
        )

    def close(self) -> None:
        """Finish the background writes and acknowledge what they made durable, give back the leases whose
        updates are in no durable checkpoint, then close the Redis connections (leader)."""
        self._stop_followers()
        self.publisher.close()
        self.persist.close()
        self.tracker.close()
        if self.delivery is not None and self.buffer is not None and self.store is not None:
            if self.intake is not None:
                self.intake.close()  # a lease taken ahead goes back untrained
            self.delivery.ack_durable()
            self.delivery.close(release=True)
            self.buffer.close()
            self.store.close()
