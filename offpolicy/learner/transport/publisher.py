"""The learner's publish path, chosen once by `publish.transport`.

- `files`: every publish writes a verified file generation (learner/persist/), which the actors load.
- `vllm`: every publish is sent through vLLM's weight-transfer engine (transport/vllm.py) to the actors in
  the group; a file generation is still written every `publish.persist_every` publishes, at the first
  publish and at every checkpoint: the durable generation that starting, restarted and failed actors load
  before they join the group. A failed send is counted and logged; training and file generations go on.

On N ranks (`vllm`) with a broadcast backend (`nccl`, `gloo`), the full weights reach rank 0's host memory
once per version, gathered in the background as the files transport's are (persist/rank_gathers.py): a
version due as files is written from that copy, and rank 0 sends each version at the first step boundary
after its gather completed (one gathering, the newest waiting: a version outrun by a newer one is not
sent). Neither the gather nor the write is on the step's critical path; the followers never wait on the
actors, and no rank but 0 holds more than its shards. With an m2n
backend (`nccl_m2n`, `gloo_m2n`) nothing is gathered: every rank sends its own shards (transport/m2n.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from prometheus_client import Counter, Gauge, Histogram

from offpolicy.learner.transport.base import TransferResult, WeightTransport

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.distributed.ranks import Ranks
    from offpolicy.learner.persist.durable_writes import Persistence

log = logging.getLogger(__name__)


class TransferMetrics:
    """The learner's transfer metrics (`publish.transport: vllm`), declared next to the `Publisher` that
    records them; the learner's other metrics are `LearnerMetrics` (learner/metrics.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.seconds = Histogram(
            "offpolicy_learner_transfer_seconds",
            "Seconds one weight transfer took at the learner (group re-formed when needed, send, answers)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r,
        )  # fmt: skip
        self.bytes = Counter(
            "offpolicy_learner_transfer_bytes_total",
            "Bytes sent to the group (with an m2n backend, every learner rank's share)",
            registry=r,
        )
        self.group_size = Gauge(
            "offpolicy_learner_transfer_group_size",
            "Actors in the transfer group at the last send",
            registry=r,
        )
        self.transfers = Counter(
            "offpolicy_learner_transfers_total", "Versions sent to the group", registry=r
        )
        self.failures = Counter(
            "offpolicy_learner_transfer_failures_total",
            "Sends that failed (the group is re-formed)",
            registry=r,
        )
        self.version = Gauge(
            "offpolicy_learner_transfer_version", "Newest version every group member confirmed", registry=r
        )
        self.dropped = Counter(
            "offpolicy_learner_transfer_members_dropped_total",
            "Members found dead during a send (heartbeats stopped) and left out of it",
            registry=r,
        )
        self.delta_rounds = Counter(
            "offpolicy_learner_transfer_delta_rounds_total",
            "Versions sent as the values changed since the last one every member holds (publish.delta)",
            registry=r,
        )
        self.delta_share = Gauge(
            "offpolicy_learner_transfer_delta_share",
            "Bytes of the last send over the bytes of that version whole (1 for a version sent whole)",
            registry=r,
        )
        self.dead_wait = Histogram(
            "offpolicy_learner_transfer_dead_wait_seconds",
            "Seconds a send spent on members that died in it (finding them, sending again to the others)",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r,
        )  # fmt: skip

    def observe(self, result: TransferResult) -> None:
        self.group_size.set(result.group_size)
        if result.dropped:
            self.dropped.inc(len(result.dropped))
            self.dead_wait.observe(result.dead_wait_s)
        if not result.ok:
            self.failures.inc()
            return
        if result.group_size:
            self.seconds.observe(result.seconds)
            self.bytes.inc(result.bytes)
            self.transfers.inc()
            if result.full_bytes:
                self.delta_rounds.inc()
            self.delta_share.set(result.bytes / result.full_bytes if result.full_bytes else 1.0)
            self.version.set(result.version)


class Publisher:
    """Files every `persist_every` publishes (all of them with `transport: files`) plus the transport.

    `gather` (N ranks, `transport: vllm`): (model, publish dtype, bucket bytes, leader): every rank joins
    each publish's background gather (persist/rank_gathers.py); the leader's transport reads the gathered
    tensors (`gathered`) while `send_gathered` runs."""

    def __init__(
        self,
        config: LearnerConfig,
        persist: Persistence,
        transport: WeightTransport | None,
        metrics: TransferMetrics | None,
        gather: tuple[torch.nn.Module, torch.dtype, int, bool] | None = None,
        stuck: Counter | None = None,
    ) -> None:
        self.config, self.persist, self.transport, self.metrics = config, persist, transport, metrics
        self.stuck_counter = stuck  # LearnerMetrics.transfer_stuck: declared whatever the transport
        self.publishes = 0  # the same count on every rank: file writes stay a collective in step
        self.persisted: int | None = None  # newest version written as files by this publisher
        self.last: TransferResult | None = None
        self._gather = gather
        self._gathered: dict[str, torch.Tensor] = {}
        self._stuck = 0  # the transport's stuck teardowns counted so far

    @property
    def transfers(self) -> bool:
        """Whether versions go through a transport (every rank agrees: the config says so)."""
        return self.config.publish.transport != "files"

    def gathered(self) -> dict[str, torch.Tensor]:
        """N ranks: the full weights of the publish being sent (the leader's; the transport's source)."""
        return self._gathered

    def publish(self, version: int, gather: set[str] | None) -> None:
        every = self.config.publish.persist_every if self.transfers else 1
        due = self.publishes % every == 0
        self.publishes += 1
        if self._gather is not None and gather is not None:  # every rank, in step
            # gathered in the background (persist/rank_gathers.py): written when due, and sent by the
            # leader (`send_gathered`) at the first step boundary after its gather completed
            self.persist.publish(version, gather, write=due)
            self.persisted = version if due else self.persisted
            return
        if due:
            self.persist_files(version, gather)
        if self.transport is not None:
            self._send(version)

    def send_gathered(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """N ranks, the leader: send `version` from its gathered host tensors (`gathered` while it runs)."""
        if self.transport is None:
            return
        self._gathered = tensors
        try:
            self._send(version)
        finally:
            self._gathered = {}  # the host set is the next gather's

    def _send(self, version: int) -> None:
        assert self.transport is not None
        self.last = self.transport.send(version)
        stuck = getattr(self.transport, "stuck", 0)
        if self.metrics is not None:
            self.metrics.observe(self.last)
        if self.stuck_counter is not None:
            self.stuck_counter.inc(stuck - self._stuck)
        self._stuck = stuck
        if self.last.ok and self.last.group_size and self.metrics is not None:
            last = self.last
            share = ""
            if last.full_bytes:  # a delta round (publish.delta)
                share = f", a delta: {last.bytes / last.full_bytes:.4f} of the version whole"
            log.info(
                "sent v%d to %d actor(s) in %.3f s (%d bytes%s)",
                version, last.group_size, last.seconds, last.bytes, share,
            )  # fmt: skip

    def status(self) -> dict[str, Any] | None:
        """`/v1/status`'s `transfer` (None with `transport: files`): the last send's version, outcome and
        error, the members it reached, whether a stuck send or teardown still unwinds (sends fail at once
        meanwhile) and how many teardowns outlived their bound."""
        if self.transport is None:
            return None
        last = self.last
        return {
            "last_version": None if last is None else last.version,
            "ok": None if last is None else last.ok,
            "error": None if last is None or last.ok else last.error,
            "group_size": 0 if last is None else last.group_size,
            "unwinding": bool(getattr(self.transport, "busy", False)),
            "stuck": self._stuck,
        }

    def persist_files(self, version: int, gather: set[str] | None) -> None:
        """Write `version` as a file generation unless it already is."""
        if self.persisted != version:
            self.persist.publish(version, gather)
            self.persisted = version

    def at_checkpoint(self, version: int, gather: set[str] | None) -> None:
        """A checkpoint is a durable point for the actors too: its version as a file generation."""
        if self.transfers:  # every rank: on N ranks the file write is a collective
            self.persist_files(version, gather)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def make_publisher(
    config: LearnerConfig,
    persist: Persistence,
    model: torch.nn.Module,
    dtype: torch.dtype,
    registry: CollectorRegistry,
    ranks: Ranks,
    stuck: Counter | None = None,
) -> Publisher:
    """The publish path for `offpolicy.learner.config.publish.transport`, on every rank: with a broadcast
    backend the leader
    sends what every rank gathers to it; with an m2n backend every rank sends its own shards."""
    if config.publish.transport == "files":
        return Publisher(config, persist, None, None)
    from offpolicy.weights.control import LearnerControl

    control = LearnerControl(config.redis_url, config.run_id) if ranks.is_leader else None
    metrics = TransferMetrics(registry) if ranks.is_leader else None
    if config.publish.transfer.sharded:
        from offpolicy.learner.transport.m2n import ShardedTransport

        transport = ShardedTransport(config.publish.transfer, control, model, dtype, ranks)
        return Publisher(config, persist, transport, metrics, stuck=stuck)
    bucket = config.publish.gather_bucket_mb * 2**20
    gather = (model, dtype, bucket, ranks.is_leader) if ranks.distributed else None
    publisher = Publisher(config, persist, None, None, gather=gather, stuck=stuck)
    # N ranks: every version gathered to the leader in the background, sent from its host memory
    persist.gathers.keep = gather is not None
    persist.gathers.send = publisher.send_gathered if gather is not None and ranks.is_leader else None
    if control is None:
        return publisher
    from offpolicy.learner.model.load import unique_state
    from offpolicy.learner.model.moe import is_moe
    from offpolicy.learner.model.moe_names import to_checkpoint
    from offpolicy.learner.transport.vllm import VllmTransport

    state = publisher.gathered if ranks.distributed else (lambda: unique_state(model))
    if is_moe(
        model.config
    ):  # fused experts sent per expert, under the checkpoint's names (model/moe_names.py)
        named, config = state, model.config
        state = lambda: to_checkpoint(named(), config)  # noqa: E731
    pc, delta = config.publish, None
    if pc.delta != "off" and config.lora is None:
        from offpolicy.weights.engines.delta_rounds import DeltaSends

        delta = DeltaSends(pc.delta, pc.full_every, pc.delta_share)
    publisher.transport = VllmTransport(pc.transfer, control, state, dtype, ranks.local_rank, delta)
    publisher.metrics = metrics
    return publisher
