"""What the leader takes from the buffer for a step, and what it gives back after: the leader's side of the
replay buffer, owned by the `Learner` (learner/trainer.py) on rank 0.

    lease `groups_per_step` → screen (an untrainable group goes to the dead-letter list; the rest of the
    batch trains) → dynamic sampling (`screening`: dropped groups replaced by more leases, bounded rounds)
    → the drops consumed (acked with the step, never trained) → prioritized replay's importance weights
    (`priorities.beta`) on the groups → [the step trains them] → `trained`: their leases consumed, each
    group's new priority with its ack (`priorities.update`).

Leases go through `Delivery` (learner/delivery.py): acked after the update (`delivery: step`) or once a
checkpoint holding it is durable (`checkpoint`), so nothing is lost and nothing trained twice, dropped
groups included.

With `prefetch` the first lease of the next step (the sample script, the payloads' transfer, their decoding
and validation: the part that waits on Redis and the codec) runs in a background thread while this step
trains, at the policy version the next step will train at. `take` uses it when the version and the
intake's settings are still those it was leased under; otherwise (a config change, a step that failed and
did not advance the version) it is given back and the step leases anew. Everything else (screening,
refills, drops, importance weights) stays on the step's thread. A lease taken ahead is renewed like every
other (the consumer's renewal thread), and given back at `close`; a learner killed holding one loses
nothing: its restart releases it, or it expires.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from offpolicy.buffer.errors import BufferNotReady, RateLimited
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.samplers import group_priority
from offpolicy.buffer.types import Leased
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.screening import ScreeningConfig
from offpolicy.learner.delivery import Delivery
from offpolicy.learner.metrics import LearnerMetrics, timed
from offpolicy.learner.rl import ModelLimits, Rejection, StepResult, field_label, screen
from offpolicy.learner.rl.dynamic_sampling import Filled, fill
from offpolicy.learner.rl.priorities import importance_weights, priority, weighted

log = logging.getLogger(__name__)

PREFETCH_WAIT_S = 2.0
"""The longest a lease taken ahead waits for enough groups (then the step leases itself, waiting
`sample_timeout_s`): `close` never waits longer for one under way."""


@dataclass(frozen=True, slots=True)
class Taken:
    """A step's groups: those to train (importance weights on them), the lease of every group leased
    (trained or dropped) by id, and dynamic sampling's metrics (empty when `screening` is off)."""

    groups: list
    lease_of: dict[str, str]
    dropped: int
    metrics: dict[str, float]
    images: dict[str, bytes] = field(default_factory=dict)  # the bytes of the images the groups show


@dataclass(frozen=True, slots=True)
class Ahead:
    """The next step's first lease, taken in the background (`Intake.prefetch`): what it was leased for
    (the policy version and the intake's settings) and its outcome."""

    key: tuple[Any, ...]
    future: Future


def lease_key(cfg: LearnerConfig, version: int) -> tuple[Any, ...]:
    """What a step's first lease depends on: a lease taken ahead is used only when these are unchanged."""
    return (version, cfg.groups_per_step, cfg.sample_timeout_s, cfg.lease_s, cfg.buffer)


class Intake:
    """The leader's lease, screen, refill, drop and acknowledgement (module docstring)."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        delivery: Delivery,
        metrics: LearnerMetrics,
        limits: ModelLimits,
        check_images: Callable[[Any, Mapping[str, bytes]], str | None] | None = None,
    ) -> None:
        self.buffer, self.delivery, self.metrics, self.limits = buffer, delivery, metrics, limits
        self.check_images = check_images  # a vision-language policy's check of a group's images, else None
        self._images: dict[str, bytes] = {}  # the images read for the step being taken
        self.groups_dropped: dict[str, int] = {}  # dynamic sampling: groups dropped since start, by reason
        self._ahead: Ahead | None = None  # the next step's first lease, under way or done
        self._pool: ThreadPoolExecutor | None = None  # its thread, started at the first prefetch
        self.prefetched = 0  # steps whose first lease was taken ahead and used (what tests check)

    def take(self, cfg: LearnerConfig, version: int, phases: dict[str, float]) -> Taken:
        """Lease and screen `groups_per_step` groups for a step at policy `version`, refill what dynamic
        sampling drops, consume the drops, weight the rest (`BufferNotReady` / `RateLimited`: no data)."""
        with timed(phases, "sample_wait"):  # a lease taken ahead: only what is left of it
            leased = self.first_lease(cfg, version)
        self._images = {}
        lease_of: dict[str, str] = {}  # group id -> lease id
        groups = self.screened(leased, lease_of)
        with timed(phases, "sample_wait"):  # dynamic sampling: dropped groups replaced by more leases
            filled = fill(
                groups, cfg.screening, lambda n: self.screened(self.lease_more(cfg, version, n), lease_of)
            )
        self.drop(cfg, filled, lease_of)
        sifted = filled.metrics() if cfg.screening != ScreeningConfig() else {}
        kept = self.weighted(cfg, filled.groups)
        shown = {sha: self._images[sha] for g in kept for sha in g.images}
        return Taken(kept, lease_of, len(filled.dropped), sifted, shown)

    def prefetch_after(
        self, cfg: LearnerConfig, version: int, groups: int, step_count: int, cuda: bool
    ) -> None:
        """Before a step of `groups` groups at `version` (the `step_count`-th) trains: with `prefetch` (None:
        on with CUDA) lease the next step's groups, at the version this step will make (its optimizer steps:
        `ppo_epochs` x its mini-batches); not after the last step (`max_steps`)."""
        on = cfg.prefetch if cfg.prefetch is not None else cuda
        if on and not (cfg.max_steps is not None and step_count + 1 >= cfg.max_steps):
            self.prefetch(
                cfg, version + cfg.ppo_epochs * math.ceil(groups / (cfg.mini_batch_groups or groups))
            )

    def prefetch(self, cfg: LearnerConfig, version: int) -> None:
        """Start the next step's first lease, for policy `version`, in the background (module docstring);
        nothing when one is already under way."""
        if self._ahead is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="offpolicy-intake-prefetch")
        wait = min(cfg.sample_timeout_s, PREFETCH_WAIT_S)
        self._ahead = Ahead(lease_key(cfg, version), self._pool.submit(self._lease, cfg, version, wait))

    def first_lease(self, cfg: LearnerConfig, version: int) -> Any:
        """The step's first `groups_per_step` groups: the lease taken ahead when it was taken for this
        `version` and these settings (its error, no data say, is this lease's), else a lease now (one taken
        ahead for something else is given back)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.key == lease_key(cfg, version):
            try:
                leased = ahead.future.result()  # waits for what is left of it
            except Exception as exc:  # no data then, Redis away: the lease now says what next
                log.debug("the lease taken ahead failed, leasing now: %s", exc)
            else:
                self.prefetched += 1
                return leased
        elif ahead is not None:
            self._give_back(ahead, "the version or the intake's settings changed")
        return self._lease(cfg, version)

    def close(self) -> None:
        """Give back a lease taken ahead (never trained) and stop the prefetch thread."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._give_back(ahead, "the learner is closing")
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _lease(self, cfg: LearnerConfig, version: int, wait_s: float | None = None) -> Any:
        return self.buffer.lease(
            cfg.groups_per_step, version, cfg.sample_timeout_s if wait_s is None else wait_s,
            consumer=self.delivery.consumer, lease_s=cfg.lease_s,
        )  # fmt: skip

    def _give_back(self, ahead: Ahead, why: str) -> None:
        """Release the leases of `ahead` (waiting for it to end); its failure, or Redis failing now, is
        logged: such leases expire, or the next start releases them."""
        try:
            leased = ahead.future.result()
            self.buffer.release(self.delivery.consumer, list(leased.lease_ids))
        except Exception as exc:  # a lease that failed holds nothing
            log.info("the next step's lease taken ahead is dropped (%s): %s", why, exc)
            return
        log.info("the next step's lease taken ahead is given back: %s", why)

    def screened(self, leased: Any, lease_of: dict[str, str]) -> list:
        """The leased groups the model can train (learner/rl/screening.py); the others set aside in the
        dead-letter list, so the rest of the batch trains. Records each group's lease in `lease_of`. A
        group this step already holds (a refill under replay may draw it again) is not taken twice: its
        second lease is released at once (its use goes back to the buffer)."""
        fresh, again = [], []
        for g, lid in zip(leased.groups, leased.lease_ids, strict=True):
            if g.group_id in lease_of:
                again.append(lid)
            else:
                lease_of[g.group_id] = lid
                fresh.append(g)
        if again:
            self.buffer.release(self.delivery.consumer, again)
        groups, rejected = screen(fresh, self.limits)
        groups, bad_images = self._images_checked(groups)
        for r in [*rejected, *bad_images]:
            self.buffer.dead_letter(self.delivery.consumer, lease_of[r.group.group_id], r.reason, r.field)
            log.warning("group %s set aside: %s: %s", r.group.group_id, r.field, r.reason)
            self.metrics.groups_rejected.labels(field=field_label(r.field)).inc()
        return groups

    def _images_checked(self, groups: list) -> tuple[list, list[Rejection]]:
        """A vision-language policy's groups that show images: their images read from the buffer (one MGET,
        kept for the step) and each group checked (`check_images`: its images decode and fill its
        prompt's image tokens); a group whose image is gone or fails is set aside (`images`)."""
        shas = {sha for g in groups for sha in g.images} - set(self._images)
        if self.check_images is None or not shas:
            return groups, []
        self._images |= self.buffer.images(shas, missing_ok=True)
        kept, bad = [], []
        for g in groups:
            missing = [sha for sha in g.images if sha not in self._images]
            why = f"image {missing[0]} is not in the buffer" if missing else None
            why = why or (self.check_images(g, self._images) if g.images else None)
            if why is None:
                kept.append(g)
            else:
                bad.append(Rejection(g, "images", why))
        return kept, bad

    def lease_more(self, cfg: LearnerConfig, version: int, n: int) -> Any:
        """Dynamic sampling's refill: `n` more groups, waiting at most `screening.refill_timeout_s`; fewer
        there: one; none (or rate-limited): an empty lease, and the step trains what it has."""
        for want in dict.fromkeys((n, 1)):
            try:
                return self.buffer.lease(
                    want, version, cfg.screening.refill_timeout_s, consumer=self.delivery.consumer,
                    lease_s=cfg.lease_s,
                )  # fmt: skip
            except (BufferNotReady, RateLimited):
                continue
        return Leased(consumer=self.delivery.consumer, groups=[], lease_ids=[])

    def drop(self, cfg: LearnerConfig, filled: Filled, lease_of: dict[str, str]) -> None:
        """Dropped groups are consumed: their leases are held (and acked) like trained ones, never trained;
        with `priorities.update` each gets priority 0 (it teaches nothing as it is: drawn again only
        through `priority_epsilon`)."""
        if not filled.dropped:
            return
        dropped = [d.group for d in filled.dropped]
        leases = [lease_of[g.group_id] for g in dropped]
        self.delivery.trained(leases, [0.0] * len(leases) if cfg.priorities.update else None)
        for d in filled.dropped:
            self.metrics.groups_dropped.labels(reason=d.reason).inc()
            self.groups_dropped[d.reason] = self.groups_dropped.get(d.reason, 0) + 1
        if filled.short:
            log.info(
                "dynamic sampling: %d group(s) dropped, %d trainable after %d refill round(s)",
                len(filled.dropped), len(filled.groups), filled.rounds,
            )  # fmt: skip

    def trained(
        self,
        cfg: LearnerConfig,
        version: int,
        lease_ids: list[str],
        groups: list,
        result: StepResult,
    ) -> None:
        """The trained groups' leases are consumed; with `priorities.update` each group's new priority at
        `version` goes with its ack (learner/rl/priorities.py), its IS deviation from `result`, the step
        that trained it."""
        if not cfg.priorities.update:
            self.delivery.trained(lease_ids)
            return
        decay, norm = cfg.priorities.staleness_decay, cfg.norm_adv_by_std_in_grpo
        deviation = result.group_is_deviation or (0.0,) * len(groups)
        new = [
            priority(g, version, decay, cfg.adv_estimator, norm, dev)
            for g, dev in zip(groups, deviation, strict=True)
        ]
        self.delivery.trained(lease_ids, new)

    def weighted(self, cfg: LearnerConfig, groups: list) -> list:
        """With `priorities.beta` > 0 under the `prioritized` sampler: the groups carrying their importance
        weights, from their current priorities in the buffer (learner/rl/priorities.py)."""
        table = cfg.buffer
        if cfg.priorities.beta == 0 or table.sampler != "prioritized" or not groups:
            return groups
        now = self.buffer.priorities([g.group_id for g in groups])
        ps = [p if p is not None else group_priority(g) for p, g in zip(now, groups, strict=True)]
        beta = cfg.priorities.beta
        return weighted(groups, importance_weights(ps, table.priority_epsilon, table.priority_alpha, beta))
