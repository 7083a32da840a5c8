"""`Persistence`: the learner's durable writes (file generations, checkpoints) off the critical path; resume.

`Persistence` owns the background writer (persist/writer.py), the weights' host snapshots
(persist/file_generation.py; on N ranks distributed/gather.py) and one checkpoint backend
(persist/checkpoint.py), chosen once by `make_checkpoints`. At a step boundary `publish` / `checkpoint`
start host copies that overlap the next step's forward and backward passes and queue their writes; `fence`
(called just before the next optimizer step changes the weights) waits for the copies. `on_durable(kind,
version)` tells the learner when a write is durable: weights announced to the actors, or a checkpoint on
disk (what delivery acknowledgements wait for). `restore_latest` loads the newest checkpoint of this run and
refuses another run's or model's. A LoRA learner (`lora:` set) publishes the adapter alone, on one process
and on N ranks alike (persist/file_generation.py: the adapter folder, a record of kind `lora`).

A write that fails with an `OSError` (a full disk, an I/O error) is back-pressure, not an outage: counted
(`offpolicy_learner_write_failures_total{kind,reason}`), logged once per spell with the path and the bytes
it needs, its partial folder removed at once, and retried by the writer with backoff while training goes
on (the newest version replaces an older one still waiting: intermediate versions may be skipped, never
half-written). `troubles` names what is failing (`/v1/status`) until a write of that kind succeeds.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from offpolicy.config.secrets import redact_url
from offpolicy.learner.distributed.ranks import SINGLE, Ranks
from offpolicy.learner.metrics import timed
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.lora import adapter_config, is_adapter_name
from offpolicy.learner.persist.background_gather import BackgroundGather, close_publish_groups
from offpolicy.learner.persist.checkpoint import base_meta
from offpolicy.learner.persist.delta_versions import DeltaVersions
from offpolicy.learner.persist.file_generation import (
    HostCopy,
    WeightsSnapshot,
    adapter_state,
    publish_snapshot,
    uri_folder,
)
from offpolicy.learner.persist.rank_gathers import RankGathers
from offpolicy.learner.persist.single import make_checkpoints
from offpolicy.learner.persist.version_folders import remove_leftovers
from offpolicy.learner.persist.writer import BackgroundWriter, Kind, WeightsBuffers
from offpolicy.weights.safetensors_io import TensorStream

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from offpolicy.learner.build import Trainables
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.metrics import LearnerMetrics
    from offpolicy.weights.record import PolicyStore

log = logging.getLogger(__name__)


class Persistence:
    """Published weights and checkpoints of one learner process."""

    def __init__(
        self,
        config: LearnerConfig,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        publish_dtype: torch.dtype,
        store: PolicyStore | None,
        metrics: LearnerMetrics,
        on_durable: Callable[[Kind, int], None] | None = None,
        ranks: Ranks = SINGLE,
    ) -> None:
        # the config at start: only its frozen fields are read here (the running one is `checkpoint`'s)
        self.config, self.model, self.tokenizer, self.publish_dtype = config, model, tokenizer, publish_dtype
        self.store, self.metrics, self._on_durable, self.ranks = store, metrics, on_durable, ranks
        self.writer = BackgroundWriter(on_done=self._written, on_failed=self._failed)
        self._weights_buffers = WeightsBuffers(self.writer)
        self._weight_copies: list[HostCopy | BackgroundGather] = []
        bucket = config.publish.gather_bucket_mb * 2**20
        self.gathers = RankGathers(  # N ranks: the publish gathers (their `keep`, `send`: the publisher's)
            model, publish_dtype, ranks, bucket, self.writer, self._write, metrics.writes_coalesced.inc,
            self._weight_copies,
        )  # fmt: skip
        self._coalesced_seen = 0
        self.deltas = DeltaVersions.of(config, ranks.is_leader)  # publish.delta, on the writing rank
        self.published_version: int | None = None  # newest version announced to the actors
        self.durable_checkpoint_version: int | None = None  # newest checkpoint on disk
        self.troubles: dict[Kind, dict[str, Any]] = {}  # kinds whose writes fail now (OSError), for status
        self._need: dict[Kind, int | None] = {}  # bytes the newest job of each kind writes (about)
        self.published_at = self.checkpointed_at = time.time()  # the ages' gauges count from the start
        # a LoRA learner's adapter_config.json, the same for every version (peft's config of `lora`)
        self._adapter = (
            adapter_config(config.lora, model, config.model_path) if config.lora is not None else None
        )
        metrics.published_age.set_function(lambda: time.time() - self.published_at)
        metrics.checkpoint_age.set_function(lambda: time.time() - self.checkpointed_at)
        for folder in (config.weights_path, config.checkpoint_path) if ranks.is_leader else ():
            if folder is not None and (gone := remove_leftovers(folder)):
                log.warning("removed %d partial write(s) left by a killed learner in %s", len(gone), folder)
        self.checkpoints = make_checkpoints(
            config,
            ranks,
            self.writer,
            lambda v, seconds: self._written("checkpoint", v, None, seconds),
            lambda v, exc: self._failed("checkpoint", v, exc, 0.0),
        )

    # --- weights

    def publish(self, version: int, gather: set[str] | None = None, write: bool = True) -> None:
        """Start the host snapshot of the weights (cast to the publish dtype) and queue their write.
        `gather`: on N ranks every rank calls this (a collective) with the names to publish, and the full
        weights are gathered from every rank's shards to the leader in the background
        (persist/rank_gathers.py): streamed into the version's files, or, when a transport sends the
        version from the leader's host memory, into its host sets, then written when `write` and sent. A
        LoRA learner publishes the adapter's tensors alone (of `gather`: those that are the adapter's)."""
        self.fence()  # the buffers about to be reused must not be mid-copy (normally long finished)
        if gather is not None:
            if self._adapter is not None:
                gather = {name for name in gather if is_adapter_name(name)}
            self.gathers.publish(version, gather, write)
            return
        into = self._weights_buffers.acquire()
        copy = HostCopy(self._published_state(), self.publish_dtype, into=into)
        self._weights_buffers.keep(copy.tensors)
        self._weight_copies.append(copy)
        self._need["weights"] = sum(t.nbytes for t in copy.tensors.values())
        self.writer.submit("weights", version, self._write(version, copy.wait), buffers=copy.tensors)
        self._count_coalesced()

    def _published_state(self) -> dict[str, torch.Tensor]:
        """One process: the tensors a version publishes (the adapter's alone for a LoRA learner)."""
        return unique_state(self.model) if self._adapter is None else adapter_state(self.model)

    def _write(
        self, version: int, tensors: Callable[[], dict[str, torch.Tensor] | TensorStream]
    ) -> Callable[[], object]:
        """The writer's job for `version`: the folder from `tensors()` (read on the writer thread)."""
        pc, store, wdir = self.config.publish, self.store, self.config.weights_path
        model, tokenizer, dtype, adapter = self.model, self.tokenizer, self.publish_dtype, self._adapter
        deltas = self.deltas

        def write() -> object:
            snap = WeightsSnapshot(
                version=version,
                tensors=tensors(),
                config=model.config,
                tokenizer=tokenizer,
                dtype=dtype,
                generation_config=getattr(model, "generation_config", None),
                adapter=adapter,
            )
            kept, root = pc.keep_versions, pc.weights_root
            record = publish_snapshot(
                snap, wdir, store=store, keep_versions=kept, weights_root=root, delta=deltas
            )
            if deltas is not None:
                self.metrics.publish_delta_share.set(deltas.bytes_share)
            return record

        return write

    def _count_coalesced(self) -> None:
        self.metrics.writes_coalesced.inc(self.writer.coalesced - self._coalesced_seen)
        self._coalesced_seen = self.writer.coalesced

    def host_sets(self) -> list[dict[str, torch.Tensor]]:
        """The host snapshot sets kept for reuse: the rank's shard snapshots and the full sets."""
        return [*self.gathers.shard_sets.sets, *self._weights_buffers.sets]

    def needs_publish(self, version: int) -> bool:
        """At start: whether `version` must be published (the policy record does not name it, in our
        folder, of our kind); actors start from it. When it need not, it counts as published."""
        record = self.store.read() if self.store is not None else None
        ours = (
            record is not None
            and record.kind == ("full" if self._adapter is None else "lora")
            and uri_folder(record.weights_uri, self.config.publish.weights_root).parent.resolve()
            == self.config.weights_path.resolve()
        )
        if record is not None and record.version == version and ours:
            self.published_version = record.version
            return False
        return True

    # --- checkpoints

    def checkpoint(
        self,
        parts: Trainables,
        version: int,
        step: int,
        buffer_position: dict[str, Any],
        lease_ids: list[str] | None = None,
        config_version: int = 0,
        lease_priorities: dict[str, float] | None = None,
        config: LearnerConfig | None = None,
    ) -> Path:
        """Snapshot everything a checkpoint holds and queue the write; return the folder it will have.
        `lease_ids`: the leases whose updates it holds (acked once it is durable: learner/delivery.py), with
        `lease_priorities` to write with their acks.
        `config`: the config the learner trains with now (None = the one this object was built with: its
        frozen fields, the folders among them, are all it reads itself), saved with `config_version` so
        that a resume reapplies it.
        Raises `CheckpointsDisabled` without a checkpoint folder."""
        running = config if config is not None else self.config
        saved = running.model_dump(mode="json") | {"redis_url": redact_url(running.redis_url)}
        meta = base_meta(
            parts,
            version=version,
            step=step,
            run_id=self.config.run_id,
            config=saved,
            buffer_position=buffer_position,
            lease_ids=lease_ids,
            config_version=config_version,
            lease_priorities=lease_priorities,
        )
        path = self.checkpoints.save(parts, version, meta)
        self._need["checkpoint"] = self.checkpoints.snapshot_bytes()
        return path

    def checkpoint_pending(self) -> bool:
        """Whether a checkpoint is being written or waits for its (re)try."""
        return self.checkpoints.pending()

    def restore_latest(self, parts: Trainables) -> dict[str, Any] | None:
        """Load the newest checkpoint of this run into `parts`; its meta, or None when there is none."""
        path = self.checkpoints.latest()
        if path is None:
            return None
        meta = self.checkpoints.load(path, parts)
        self.durable_checkpoint_version = int(meta["version"])
        self.checkpointed_at = path.stat().st_mtime
        log.info("resumed from %s at version %d", path, int(meta["version"]))
        return meta

    # --- the critical path and the writer thread

    def fence(self, phases: dict[str, float] | None = None) -> None:
        """Wait until the host snapshots taken at the last step boundary are complete (timed as the
        `publish` / `checkpoint` phases): called before the optimizer changes the weights."""
        phases = phases if phases is not None else {}
        with timed(phases, "publish"):
            for copy in self._weight_copies:  # the weights may change once their snapshot is taken
                copy.released() if isinstance(copy, BackgroundGather) else copy.wait()
        self._weight_copies.clear()
        with timed(phases, "checkpoint"):
            self.checkpoints.staged()

    def _written(self, kind: Kind, version: int, result: object, seconds: float) -> None:
        self.metrics.write_seconds.labels(kind=kind).observe(seconds)
        if kind == "weights":
            self.published_version, self.published_at = version, time.time()
            self.metrics.publishes.inc()
        else:
            self.durable_checkpoint_version, self.checkpointed_at = version, time.time()
            self.metrics.checkpoints.inc()
        if (trouble := self.troubles.pop(kind, None)) is not None:
            log.warning(
                "%s writes recovered: v%d is durable after %d failed write(s) since %s",
                kind, version, trouble["failures"], time.ctime(trouble["since"]),
            )  # fmt: skip
        if self._on_durable is not None:
            self._on_durable(kind, version)

    def _failed(self, kind: Kind, version: int, exc: OSError, retry_in_s: float) -> None:
        """A write failed with an `OSError`: counted; logged once per spell (path, bytes needed); its
        partial folders removed; named in `troubles` until a write of `kind` succeeds."""
        reason = errno.errorcode.get(exc.errno, "OSError") if exc.errno else type(exc).__name__
        self.metrics.write_failures.labels(kind=kind, reason=reason).inc()
        root = self.config.weights_path if kind == "weights" else self.config.checkpoint_path
        if root is not None and self.ranks.is_leader and not self.ranks.distributed:
            remove_leftovers(root)  # the writer's own partial folder is gone already; anything else too
        path = str(exc.filename or root)
        need = self._need.get(kind)
        previous = self.troubles.get(kind)
        self.troubles[kind] = {
            "path": path,
            "reason": reason,
            "error": f"{type(exc).__name__}: {exc}",
            "version": version,
            "bytes_needed": need,
            "since": previous["since"] if previous is not None else time.time(),
            "failures": previous["failures"] + 1 if previous is not None else 1,
            "retry_in_s": retry_in_s,
        }
        if previous is None:  # once per spell; the counter and status show the rest
            log.error(
                "%s write of v%d failed on %s (%s, about %s bytes needed): retried with backoff while "
                "training goes on: %s",
                kind, version, path, reason, need if need is not None else "?", exc,
            )  # fmt: skip

    def poll(self) -> None:
        """Step boundary: a checkpoint whose write completed becomes durable; N ranks, the leader: a version
        gathered for a transport is sent."""
        self.checkpoints.poll()
        self.gathers.poll()

    def flush(self) -> None:
        """Wait until every queued publish and checkpoint is durable (N ranks: a collective)."""
        self.gathers.finish()  # every rank: its part of the gathers
        self.checkpoints.finish()
        self.writer.flush()

    def close(self) -> None:
        """Finish the copies and the queued writes, then stop the writer."""
        self.fence()
        self.gathers.finish()  # the newest version is written, however busy the writer was
        if self.gathers.gathering is not None:  # every rank: the leader's write needs the others' shards
            close_publish_groups()
        self.checkpoints.close()
        self.writer.close()
