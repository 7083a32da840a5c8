"""The update phase of a learner step: mini-batches, micro-batch losses accumulated into AdamW steps.

`optimizer_step` is one optimizer step of spec §5.1: the mini-batch's micro-batches each take a forward
and backward pass with the mini-batch's denominators (so the accumulated gradient is the mini-batch
loss's gradient), then the gradient norm is clipped and AdamW and the LR schedule step (the critic too,
with GAE). The caller advances the policy version. Also here: the LR schedule, pi_old under no_grad and
the phase timer the train loop uses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from learner.batching import Batch, token_logprobs
from learner.checkpoint import Trainables
from learner.config import LearnerConfig, OptimizerConfig
from learner.critic import value_loss
from learner.losses import ClipConfig, compute_policy_loss
from learner.metrics import StalenessKL
from learner.precision import Precision

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
    """Split a (n,) row index into chunks of at most `size`."""
    return list(torch.split(rows, size))


def mini_batches(batch: Batch, groups_per_mini_batch: int | None) -> list[torch.Tensor]:
    """Row indices of each mini-batch: groups shuffled, `groups_per_mini_batch` at a time (None = all)."""
    n_groups = int(batch.group_index.max()) + 1
    per = groups_per_mini_batch or n_groups
    order = torch.randperm(n_groups).to(batch.group_index.device)
    return [
        torch.isin(batch.group_index, order[i : i + per]).nonzero().squeeze(-1)
        for i in range(0, n_groups, per)
    ]


def pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a (b, r) tensor with zeros to (b, width) (micro-batches trim their padding columns)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


@torch.no_grad()
def no_grad_logprobs(
    model: torch.nn.Module, batch: Batch, cfg: LearnerConfig, precision: Precision
) -> torch.Tensor:
    """pi_old: log-probs of the whole batch under the current weights, micro-batched, (B, R)."""
    width = batch.response_ids.shape[1]
    rows = micro_batches(torch.arange(batch.num_rows, device=batch.response_ids.device), cfg.micro_batch_size)
    with precision.autocast():
        parts = [token_logprobs(model, batch.select(r), cfg.logprob_chunk_tokens) for r in rows]
    return torch.cat([pad_cols(p, width) for p in parts])


def mean_metrics(acc: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Mean of each metric's 0-d tensors, moved to the host in one transfer."""
    if not acc:
        return {}
    names = list(acc)
    values = torch.stack([torch.stack([v.float().reshape(()) for v in acc[n]]).mean() for n in names])
    return dict(zip(names, values.cpu().tolist(), strict=True))


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
) -> None:
    """Gradient accumulation over the micro-batches of rows `mini`, then one AdamW step. Metrics (0-d
    tensors) are appended to `acc`; `kl = (accumulator, policy version)` adds pi_theta's off-policy KL.
    Forward passes run under the precision's autocast; backward passes and the optimizer outside it.
    `before_update(phases)` runs just before the weights change (the learner waits there for host
    snapshots of the previous step boundary, which read the weights while this step's passes ran)."""
    mask = batch.response_mask[mini]  # (b, R)
    denominators = {"tokens": mask.sum(), "rows": (mask.sum(-1) > 0).sum(), "width": mask.shape[1]}
    step_loss = torch.zeros((), device=mask.device)
    with timed(phases, "forward_backward"):
        for rows in micro_batches(mini, cfg.micro_batch_size):
            mb = batch.select(rows)
            with precision.autocast():
                log_prob = token_logprobs(t.model, mb, cfg.logprob_chunk_tokens)  # (b, r) fp32
            loss, m = policy_loss_terms(log_prob, mb, cfg, denominators)
            loss.backward()
            step_loss += loss.detach()
            if kl is not None:
                kl[0].add(log_prob, mb.rollout_log_probs, mb.response_mask, kl[1] - mb.behavior_versions)
            if t.critic is not None:
                with precision.autocast():
                    values = t.critic(mb)  # (b, r) fp32
                v_loss, vm = value_loss(
                    values, mb.values, mb.returns, mb.sampled_mask, cfg.critic.cliprange_value
                )
                (v_loss * cfg.critic.loss_coef * len(rows) / len(mini)).backward()
                m |= vm
            for k, v in m.items():
                acc.setdefault(k, []).append(v)
    if before_update is not None:
        before_update(phases)
    with timed(phases, "optimizer"):
        limit = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        acc.setdefault("grad_norm", []).append(torch.nn.utils.clip_grad_norm_(t.model.parameters(), limit))
        acc.setdefault("loss", []).append(step_loss)
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        if t.critic is not None and t.critic_optimizer is not None:
            torch.nn.utils.clip_grad_norm_(t.critic.parameters(), limit)
            t.critic_optimizer.step()
            t.critic_optimizer.zero_grad(set_to_none=True)
