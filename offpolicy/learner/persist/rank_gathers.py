"""N ranks' publishes: one background gather in flight, the newest waiting, the leader's part after it.

Every rank calls `publish` at the same step boundary (a collective): each snapshots its shards (all that the
step waits for, `Persistence.fence`); the gather to rank 0 (persist/background_gather.py) starts at once
when the previous one is done on every rank, else the snapshot waits, replacing an older waiting one
(coalesced: `offpolicy_learner_writes_coalesced_total`, newest first, as the writer does on one process),
until the next publish, `finish` (flush, close). Whether the previous one is done is one all-reduce (MAX of
every rank's `busy`) of the control group: the same answer on every rank, so the shard group's gathers pair
up in order, and none waits for another inside a step.

The leader, by transport:

- files (`keep` false): the gather streams into the version's files (the writer reads its buckets as they
  arrive); done once the stream is written.
- `vllm` with a broadcast backend (`keep`): the gather fills one of the leader's two full host sets (the
  next gather takes the other); a version due as files (`publish.persist_every`, a checkpoint's) is written
  from it by the writer, and every version is sent (`send`, the transport's) on the training thread at the
  first step boundary after its gather completed (`poll`). Done once gathered, written and sent. The
  gather and the write are off the step's critical path; the send is on it, as on one process (vLLM's
  engines receive while they pause).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from offpolicy.learner.persist.background_gather import BackgroundGather, ShardSets

if TYPE_CHECKING:
    from offpolicy.learner.distributed.ranks import Ranks
    from offpolicy.learner.persist.writer import BackgroundWriter
    from offpolicy.weights.safetensors_io import TensorStream

log = logging.getLogger(__name__)

WriteJob = Callable[[int, Callable[[], "dict[str, torch.Tensor] | TensorStream"]], Callable[[], object]]
"""`Persistence._write`: the writer's job writing `version` from what the callable returns."""


@dataclass
class Gather:
    """One version's background gather and the leader's part after it."""

    version: int
    copy: BackgroundGather
    write: bool  # written as a file generation
    sent: bool  # sent by the transport (or nothing to send)
    submitted: bool = False  # its write is queued


class RankGathers:
    """The publish gathers of one rank (module docstring). `keep` and `send` are the publisher's
    (transport/publisher.py `make_publisher`): the leader keeps each version to send it with `send`."""

    def __init__(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype,
        ranks: Ranks,
        bucket_bytes: int,
        writer: BackgroundWriter,
        write_job: WriteJob,
        coalesced: Callable[[], None],
        copies: list,
    ) -> None:
        self.model, self.dtype, self.ranks, self.bucket_bytes = model, dtype, ranks, bucket_bytes
        self.writer, self.write_job, self.coalesced, self.copies = writer, write_job, coalesced, copies
        self.keep = False
        self.send: Callable[[int, dict[str, torch.Tensor]], None] | None = None
        self.shard_sets = ShardSets()
        self.gathering: Gather | None = None  # started (the newest started)
        self.waiting: Gather | None = None  # snapshotted, not started
        self._spare: dict[str, torch.Tensor] | None = None  # keep, the leader: the full set not in use

    def publish(self, version: int, gather: set[str], write: bool = True) -> None:
        """Every rank: snapshot this rank's shards of `gather` for `version`, and start or queue the gather.
        `write`: written as files (always, without `keep`). A version asked again (a checkpoint's, after
        its publish) is written too."""
        for g in (self.waiting, self.gathering):
            if g is not None and g.version == version:
                if write and not g.write:
                    g.write = True
                    if g is self.gathering:
                        self._submit(g)
                return
        leader, replaced = self.ranks.is_leader, self.waiting
        into = None
        if self.keep and leader:
            into = replaced.copy.tensors if replaced is not None else self._spare
            self._spare = None
        copy = BackgroundGather(
            self.model, gather, self.dtype, leader, into, self.bucket_bytes, self.keep, self.shard_sets
        )
        self.copies.append(copy)  # the step's fence waits for its snapshot
        if replaced is not None:
            self.coalesced()
        write = write or not self.keep or (replaced is not None and replaced.write)
        self.waiting = Gather(version, copy, write, sent=not (self.keep and leader and self.send is not None))
        self.start(block=False)

    def start(self, block: bool) -> None:
        """Start the waiting gather when the one before is done on every rank (`block`: wait for it here;
        else a collective of the control group, when one was started before)."""
        if self.waiting is None:
            return
        if self.gathering is not None:
            if not block:
                self.poll()
                busy = torch.tensor([int(self._busy(self.gathering))])
                dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.ranks.control)
                if busy.item():
                    return
            self._finish(self.gathering)
            if self.keep and self.ranks.is_leader:
                self._spare = self.gathering.copy.tensors
        g, self.waiting = self.waiting, None
        g.copy.start()
        self.gathering = g
        self._submit(g)

    def poll(self) -> None:
        """The leader at a step boundary (`keep`): send the version whose gather has completed."""
        if self.gathering is not None:
            self._send(self.gathering, block=False)

    def finish(self) -> None:
        """Every rank (a flush or close of every rank): the waiting version started, and everything done."""
        self.start(block=True)
        if self.gathering is not None:
            self._finish(self.gathering)

    def _busy(self, g: Gather) -> bool:
        """This rank's part of `g` is not done: its gather runs; the leader's stream is not written (files),
        or its write is not done or it is not sent (`keep`)."""
        if g.copy.busy():
            return True
        if not (self.keep and self.ranks.is_leader):
            return False
        return not g.sent or (g.submitted and self.writer.pending("weights"))

    def _finish(self, g: Gather) -> None:
        """Block until `g` is done on this rank (re-raises its gather's failure)."""
        g.copy.wait()
        if self.keep and self.ranks.is_leader:
            self._send(g, block=True)
            if g.submitted:
                self.writer.flush(kind="weights")

    def _send(self, g: Gather, block: bool) -> None:
        if g.sent or (not block and g.copy.reads()):
            return
        g.sent = True
        try:
            tensors = g.copy.wait()
        except Exception:  # the writer reports it too when the version is written; the next is sent
            log.exception("the publish gather of v%d failed: not sent", g.version)
            return
        self.send(g.version, tensors)  # type: ignore[misc]  (sent is False only with a send)

    def _submit(self, g: Gather) -> None:
        """The leader: queue `g`'s write once its gather has started (a failed write is not retried: the
        stream is read once, and a kept set is needed for the next gather; the next version supersedes)."""
        if not self.ranks.is_leader or not g.write or g.submitted:
            return
        g.submitted = True
        if self.keep:
            self.writer.submit("weights", g.version, self.write_job(g.version, g.copy.wait), retry=False)
            return
        try:
            self.writer.submit("weights", g.version, self.write_job(g.version, g.copy.stream), retry=False)
        except BaseException:
            try:  # read to its end: the gather thread must not block on it
                for _ in g.copy.stream().chunks:
                    pass
            finally:
                raise
