"""The update phase of a learner step: mini-batches, micro-batch losses accumulated into AdamW steps.

`optimizer_step` is one optimizer step of spec §5.1: the mini-batch's micro-batches each take a forward
and backward pass with the mini-batch's denominators (so the accumulated gradient is the mini-batch
loss's gradient), then the gradient norm is clipped and AdamW and the LR schedule step (the critic too,
with GAE). The caller advances the policy version. Also here: the LR schedule, pi_old under no_grad and
the phase timer the train loop uses.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from learner.batching import Batch
from learner.checkpoint import Trainables
from learner.config import LearnerConfig, OptimizerConfig
from learner.critic import value_loss
from learner.distributed import SINGLE, Ranks, all_reduce_sum, shares
from learner.losses import ClipConfig, compute_policy_loss
from learner.metrics import StalenessKL
from learner.precision import Precision
from learner.sharding import clip_grad_norm, loss_scale

# --- schedule and timing


def lr_lambda(cfg: OptimizerConfig) -> Callable[[int], float]:
    """LR multiplier at optimizer step s: linear warm-up, then constant / linear / cosine decay."""

    def factor(s: int) -> float:
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.decay == "constant" or cfg.decay_steps is None:
            return 1.0
        frac = min(1.0, (s - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps))
        shape = 1.0 - frac if cfg.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return factor


def set_optimizer_hparams(
    opt: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimizerConfig
) -> None:
    """Apply a new optimizer config in place (moments and the schedule's step kept). The next optimizer
    step trains at `cfg.lr` times the new schedule's factor: `LambdaLR` multiplies its own `base_lrs`, so
    those move too (a PATCH of `optimizer.lr` changing only `initial_lr` would change nothing)."""
    for g in opt.param_groups:
        g.update(betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr for _ in opt.param_groups]
    scheduler.lr_lambdas = [lr_lambda(cfg) for _ in opt.param_groups]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for g in opt.param_groups:
        g["lr"] = cfg.lr * factor


@contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the block to `phases[name]` (seconds); syncs CUDA so GPU time is counted."""
    t0 = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


# --- rows, mini-batches, metrics


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Split a (n,) row index into chunks of at most `size` (none for no rows: `torch.split` would give
    one empty chunk, a pass over zero rows)."""
    return list(torch.split(rows, size)) if rows.numel() else []


def mini_batches(
    batch: Batch, groups_per_mini_batch: int | None, generator: torch.Generator
) -> list[torch.Tensor]:
    """Row indices of each mini-batch: groups shuffled by `generator` (every rank draws the same order),
    `groups_per_mini_batch` at a time (None = all)."""
    n_groups = int(batch.group_index.max()) + 1
    per = groups_per_mini_batch or n_groups
    order = torch.randperm(n_groups, generator=generator).to(batch.group_index.device)
    return [
        torch.isin(batch.group_index, order[i : i + per]).nonzero().squeeze(-1)
        for i in range(0, n_groups, per)
    ]


def rank_micro_batches(
    batch: Batch, rows: torch.Tensor, size: int, ranks: Ranks
) -> list[torch.Tensor | None]:
    """This rank's micro-batches of the global rows `rows` (its share: whole groups, balanced by tokens),
    padded with `None` to the micro-batch count of the busiest rank: every rank runs as many forward and
    backward passes (FSDP's collectives pair up), a `None` being a pass that contributes nothing."""
    parts = shares(rows, batch.group_index, batch.attention_mask.sum(-1), ranks.world_size)
    count = max(math.ceil(len(p) / size) for p in parts)
    mine: list[torch.Tensor | None] = list(micro_batches(parts[ranks.rank], size))
    return mine + [None] * (count - len(mine))


def idle_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """A pass that contributes nothing: the first row of `rows`, every mask cleared."""
    mb = batch.select(rows[:1])
    return dataclasses.replace(mb, response_mask=mb.response_mask * 0, sampled_mask=mb.sampled_mask * 0)


@torch.no_grad()
def rows_forward(
    fn: Callable[[Batch], torch.Tensor], batch: Batch, size: int, ranks: Ranks = SINGLE
) -> torch.Tensor:
    """`fn` (a (b, r) result per micro-batch: log-probs, values) over the whole batch, (B, R): each rank
    runs its share, the results are summed across ranks (exact: the other rows are zeros)."""
    width = batch.response_ids.shape[1]
    rows = torch.arange(batch.num_rows, device=batch.response_ids.device)
    out = torch.zeros(batch.num_rows, width, device=rows.device)
    for mb_rows in rank_micro_batches(batch, rows, size, ranks):
        if mb_rows is None:
            fn(idle_rows(batch, rows))  # the other ranks' collectives need this pass
            continue
        part = fn(batch.select(mb_rows))
        out[mb_rows, : part.shape[1]] = part
    return all_reduce_sum(ranks, out)


def no_grad_logprobs(
    policy: torch.nn.Module, batch: Batch, cfg: LearnerConfig, precision: Precision, ranks: Ranks = SINGLE
) -> torch.Tensor:
    """pi_old: log-probs of the whole batch under the current weights, micro-batched, (B, R)."""
    with precision.autocast():
        return rows_forward(
            lambda mb: policy(mb, cfg.logprob_chunk_tokens), batch, cfg.micro_batch_size, ranks
        )


def metric_sums(acc: dict[str, list[torch.Tensor]]) -> dict[str, tuple[float, int]]:
    """(sum, count) of each metric's 0-d tensors, moved to the host in one transfer (their means, reduced
    across ranks: `distributed.reduce_means`)."""
    if not acc:
        return {}
    names = list(acc)
    sums = torch.stack([torch.stack([v.float().reshape(()) for v in acc[n]]).sum() for n in names])
    return {n: (s, len(acc[n])) for n, s in zip(names, sums.cpu().tolist(), strict=True)}


# --- the loss of one micro-batch, one optimizer step


def policy_loss_terms(
    log_prob: torch.Tensor, mb: Batch, cfg: LearnerConfig, den: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch, scaled by the mini-batch's denominators `den` so that the micro-batch
    losses add up to the mini-batch's loss (gradient accumulation); metrics as 0-d tensors."""
    rc = cfg.rollout_correction
    out = compute_policy_loss(
        log_prob,
        mb.old_log_probs,
        mb.advantages,
        mb.response_mask,
        loss_agg_mode=cfg.loss_agg_mode,
        clip=ClipConfig(
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
        ),
        rollout_is_weights=None if rc.bypass_mode else mb.is_weights,
        rollout_log_prob=mb.rollout_log_probs,
        correction=rc,
        batch_num_tokens=den["tokens"],
        global_batch_size=den["rows"],
        loss_scale_factor=den["width"],  # the mini-batch's T, not the (trimmed) micro-batch's
    )
    return out.loss, out.metrics


def optimizer_step(
    t: Trainables,
    batch: Batch,
    mini: torch.Tensor,
    cfg: LearnerConfig,
    acc: dict[str, list[torch.Tensor]],
    phases: dict[str, float],
    precision: Precision,
    kl: tuple[StalenessKL, int] | None = None,
    before_update: Callable[[dict[str, float]], None] | None = None,
    ranks: Ranks = SINGLE,
) -> None:
    """Gradient accumulation over the micro-batches of rows `mini`, then one AdamW step. Metrics (0-d
    tensors) are appended to `acc`; `kl = (accumulator, policy version)` adds pi_theta's off-policy KL.
    Forward passes run under the precision's autocast; backward passes and the optimizer outside it.
    `before_update(phases)` runs just before the weights change (the learner waits there for host
    snapshots of the previous step boundary, which read the weights while this step's passes ran).
    On N ranks each runs its share of the mini-batch's groups with the global denominators: the reduced
    gradient is that of one process on the whole mini-batch."""
    mask = batch.response_mask[mini]  # (b, R)
    denominators = {"tokens": mask.sum(), "rows": (mask.sum(-1) > 0).sum(), "width": mask.shape[1]}
    value_tokens = batch.sampled_mask[mini].sum().clamp(min=1.0)  # the critic's token-mean denominator
    scale = loss_scale(ranks)  # FSDP averages gradients over ranks; each loss is a share of the global one
    step_loss = torch.zeros((), device=mask.device)
    with timed(phases, "forward_backward"):
        for rows in rank_micro_batches(batch, mini, cfg.micro_batch_size, ranks):
            mb = batch.select(rows) if rows is not None else idle_rows(batch, mini)
            with precision.autocast():
                log_prob = t.policy(mb, cfg.logprob_chunk_tokens)  # (b, r) fp32
            if (
                rows is None
            ):  # the busy ranks' passes, in their order (FSDP's collectives pair up); no gradient
                (log_prob.sum() * 0.0).backward()
                if t.critic is not None:
                    with precision.autocast():
                        idle_values = t.critic(mb)
                    (idle_values.sum() * 0.0).backward()
                continue
            loss, m = policy_loss_terms(log_prob, mb, cfg, denominators)
            (loss * scale).backward()
            step_loss += loss.detach()
            if kl is not None:
                kl[0].add(log_prob, mb.rollout_log_probs, mb.response_mask, kl[1] - mb.behavior_versions)
            if t.critic is not None:
                with precision.autocast():
                    values = t.critic(mb)  # (b, r) fp32
                v_loss, vm = value_loss(
                    values, mb.values, mb.returns, mb.sampled_mask, cfg.critic.cliprange_value, value_tokens
                )
                (v_loss * cfg.critic.loss_coef * scale).backward()
                m |= vm
            for k, v in m.items():
                acc.setdefault(k, []).append(v)
    if before_update is not None:
        before_update(phases)
    with timed(phases, "optimizer"):
        limit = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        acc.setdefault("grad_norm", []).append(clip_grad_norm(list(t.policy.parameters()), limit))
        acc.setdefault("loss", []).append(all_reduce_sum(ranks, step_loss))
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        if t.critic is not None and t.critic_optimizer is not None:
            clip_grad_norm(list(t.critic.parameters()), limit)
            t.critic_optimizer.step()
            t.critic_optimizer.zero_grad(set_to_none=True)
