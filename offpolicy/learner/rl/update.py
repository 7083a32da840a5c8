"""One optimizer step of a learner step: micro-batch losses accumulated into one AdamW step (spec §5.1).

`optimizer_step` runs the mini-batch's micro-batches, each a forward and backward pass with the
mini-batch's denominators (so the accumulated gradient is the mini-batch loss's gradient), then clips the
gradient norm and steps AdamW and the LR schedule (the critic too, with GAE). The caller advances the
policy version.

Two kinds of lines live here, marked so: the algorithm, and `# lock-step:` lines that exist only so that
every rank of N runs the same passes and collectives in the same order (FSDP pairs them up layer by layer;
a rank that skipped one would hang the others). Idle passes mirror a busy pass exactly: policy forward and
backward, then critic forward and backward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from offpolicy.learner.batch import Batch
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.fsdp import clip_grad_norm, gradient_sync, loss_scale
from offpolicy.learner.distributed.ranks import all_reduce_sum
from offpolicy.learner.metrics import timed
from offpolicy.learner.rl.context import StepContext
from offpolicy.learner.rl.losses import (
    ClipConfig,
    aggregate_loss,
    compute_policy_loss,
    kl_penalty,
    value_loss,
)
from offpolicy.learner.rl.microbatches import idle_rows, rank_micro_batches
from offpolicy.learner.rl.staleness_kl import RoutingByStaleness, StalenessKL

log = logging.getLogger(__name__)


def policy_loss_terms(
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: Batch,
    cfg: LearnerConfig,
    den: dict[str, Any],
    router: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Loss of one micro-batch, scaled by the mini-batch's denominators `den` so that the micro-batch
    losses add up to the mini-batch's loss (gradient accumulation), as verl's actor: `pg_loss - entropy_coeff
    * entropy + kl_loss_coef * kl_loss`, the entropy (computed only with `entropy_coeff > 0`) and the KL to
    the reference (`mb.ref_log_probs`, when the KL loss is on) aggregated like the policy loss over the same
    response mask; an MoE policy's `router` losses (load balancing, z-loss: model/moe.py) weighted by
    `moe.aux_loss_coef` and `moe.z_loss_coef` and by the micro-batch's share of the mini-batch's tokens
    (`den["seq_tokens"]`: prompt and response; the z-loss then adds up to the mini-batch's token mean, the
    load-balancing loss, a product of means, stays a per-micro-batch loss). Returns (loss, metrics
    that average over micro-batches, the terms: 0-d tensors that add up over micro-batches and ranks)."""
    rc = cfg.rollout_correction
    agg = {
        "batch_num_tokens": den["tokens"],
        "global_batch_size": den["rows"],
        "loss_scale_factor": den["width"],
    }
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
        behavior_logprobs=mb.behavior_logprobs,
        correction=rc,
        **agg,  # the mini-batch's T, not the (trimmed) micro-batch's, for loss_scale_factor
    )
    loss, terms = out.loss, {"actor/pg_loss": out.loss.detach()}
    if entropy is not None:
        ent = aggregate_loss(entropy, mb.response_mask, cfg.loss_agg_mode, **agg)
        loss = loss - cfg.entropy_coeff * ent
        terms["actor/entropy"] = ent.detach()
    if mb.ref_log_probs is not None:
        kld = kl_penalty(log_prob, mb.ref_log_probs, cfg.kl_loss_type)  # (b, r)
        kl = aggregate_loss(kld, mb.response_mask, cfg.loss_agg_mode, **agg)
        loss = loss + cfg.kl_loss_coef * kl
        terms["actor/kl_loss"] = kl.detach()
    if router is not None:  # an MoE policy: its routers' losses, this micro-batch's share of the mini-batch's
        share = mb.attention_mask.sum() / den["seq_tokens"].clamp(min=1)  # tokens the routers saw
        aux, z = router[0] * share, router[1] * share
        loss = loss + cfg.moe.aux_loss_coef * aux + cfg.moe.z_loss_coef * z
        terms["moe/aux_loss"], terms["moe/z_loss"] = aux.detach(), z.detach()
    return loss, out.metrics, terms


def optimizer_step(
    ctx: StepContext,
    batch: Batch,
    mini: torch.Tensor,
    acc: dict[str, list[torch.Tensor]],
    phases: dict[str, float],
    kl: tuple[StalenessKL, int] | None = None,
    routing: RoutingByStaleness | None = None,
) -> bool:
    """Gradient accumulation over the micro-batches of rows `mini`, then one AdamW step; whether it was
    taken: a non-finite gradient norm (a NaN or inf anywhere, on any rank: the norm is global) skips it,
    the weights, AdamW state and LR schedule unchanged (one host sync per optimizer step). Metrics (0-d
    tensors) are appended to `acc`; `kl = (accumulator, policy version)` adds pi_theta's off-policy KL;
    `routing` (an MoE policy's) gets each forward's router agreement and log-prob gap by token age.
    Forward passes run under the precision's autocast; backward passes and the optimizer outside it.
    `ctx.before_update(phases)` runs just before the weights change (the learner waits there for host
    snapshots of the previous step boundary, which read the weights while this step's passes ran).
    On N ranks each runs its share of the mini-batch's groups with the global denominators: the reduced
    gradient is that of one process on the whole mini-batch."""
    cfg, t, precision = ctx.config, ctx.trainables, ctx.precision
    mask = batch.response_mask[mini]  # (b, R)
    denominators = {"tokens": mask.sum(), "rows": (mask.sum(-1) > 0).sum(), "width": mask.shape[1]}
    denominators["seq_tokens"] = batch.attention_mask[mini].sum()  # every token the routers see (MoE losses)
    value_tokens = batch.sampled_mask[mini].sum().clamp(min=1.0)  # the critic's token-mean denominator
    scale = loss_scale(
        ctx.ranks
    )  # FSDP averages gradients over ranks; each loss is a share of the global one
    step_loss = torch.zeros((), device=mask.device)
    entropy_on = cfg.entropy_coeff > 0  # the entropy costs a softmax-sized pass per LM-head chunk
    keys = ("actor/pg_loss", *(("actor/entropy",) if entropy_on else ()))
    keys += ("actor/kl_loss",) if ctx.reference is not None else ()
    keys += ("moe/aux_loss", "moe/z_loss") if getattr(t.policy, "router", None) is not None else ()
    given = batch.replay_experts if batch.replay_experts is not None else batch.routed_experts
    routed = getattr(t.policy, "router", None) is not None and given is not None
    if routed:  # shares of the mini-batch: token-layers with a row (replayed or rollout), response tokens
        keys += ("moe/router_agreement", "moe/logprob_gap")
        routed_rows = (given[mini][..., 0] >= 0).sum().clamp(min=1)  # token-layers with a row
    step_terms = torch.zeros(len(keys), device=mask.device)  # lock-step: the same keys on every rank
    with timed(phases, "forward_backward"):
        passes = list(rank_micro_batches(batch, mini, cfg, ctx.ranks))  # the same count on every rank
        for i, rows in enumerate(passes):
            # gradients reduced at the last micro-batch only (`fsdp.grad_sync`), on every rank alike
            gradient_sync([t.policy, t.critic], ctx.grad_sync, last=i == len(passes) - 1)
            if rows is None:  # lock-step: the busy ranks' passes, in their order, contributing nothing
                _idle_pass(ctx, idle_rows(batch, mini))
                continue
            mb = batch.select(rows)
            with precision.autocast():
                log_prob, entropy = t.policy(mb, cfg.logprob_chunk_tokens, cfg.packing, entropy_on)  # (b, r)
            router = getattr(t.policy, "router_losses", None)  # an MoE policy's, of this forward
            loss, m, terms = policy_loss_terms(log_prob, entropy, mb, cfg, denominators, router)
            if routed:  # own top-k == the replayed (else the rollout's) set; |log pi_theta - log mu|
                agree = t.policy.router_agreement  # (2,) long
                terms["moe/router_agreement"] = agree[0].float() / routed_rows
                gap = (log_prob.detach() - mb.behavior_logprobs).abs()  # (b, r)
                tokens = denominators["tokens"].clamp(min=1)
                terms["moe/logprob_gap"] = (gap * mb.response_mask).sum() / tokens
                if routing is not None:
                    mb_given = mb.replay_experts if mb.replay_experts is not None else mb.routed_experts
                    rows = (mb_given[..., 0, 0] >= 0).float()  # (b, r): positions with a routed row
                    ages = ctx.version - mb.versions  # (b, r): each token's age (batch.token_staleness)
                    routing.add(t.policy.router_agreement_tokens, rows, gap, mb.response_mask, ages)
            (loss * scale).backward()
            step_loss += loss.detach()
            step_terms += torch.stack([terms[k] for k in keys])
            if kl is not None:
                kl[0].add(log_prob, mb.behavior_logprobs, mb.response_mask, kl[1] - mb.versions)
            if t.critic is not None:
                with precision.autocast():
                    values = t.critic(mb, cfg.packing)  # (b, r) fp32
                v_loss, vm = value_loss(
                    values, mb.values, mb.returns, mb.sampled_mask, cfg.critic.cliprange_value, value_tokens
                )
                (v_loss * cfg.critic.loss_coef * scale).backward()
                m |= vm
            for k, v in m.items():
                acc.setdefault(k, []).append(v)
    ctx.before_update(phases)
    with timed(phases, "optimizer"):
        limit = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        norm = clip_grad_norm(list(t.policy.parameters()), limit)
        acc.setdefault("loss", []).append(all_reduce_sum(ctx.ranks, step_loss))
        for k, v in zip(keys, all_reduce_sum(ctx.ranks, step_terms), strict=True):
            acc.setdefault(k, []).append(v)
        stepped = bool(torch.isfinite(norm))  # the same on every rank: the norm is reduced over all
        if stepped:
            acc.setdefault("grad_norm", []).append(norm)
            t.optimizer.step()
            t.scheduler.step()
        else:
            log.warning("gradient norm %s: optimizer step skipped, the weights are unchanged", float(norm))
        t.optimizer.zero_grad(set_to_none=True)
        if t.critic is not None and t.critic_optimizer is not None:
            if bool(torch.isfinite(clip_grad_norm(list(t.critic.parameters()), limit))):
                t.critic_optimizer.step()
            t.critic_optimizer.zero_grad(set_to_none=True)
    return stepped


def _idle_pass(ctx: StepContext, mb: Batch) -> None:
    """lock-step: a pass with no gradient that runs the same modules in the same order as a busy one
    (policy forward and backward, then critic forward and backward), so FSDP's collectives pair up."""
    t, precision = ctx.trainables, ctx.precision
    with precision.autocast():
        log_prob, _ = t.policy(
            mb, ctx.config.logprob_chunk_tokens, ctx.config.packing, ctx.config.entropy_coeff > 0
        )
    (log_prob.sum() * 0.0).backward()
    if t.critic is not None:
        with precision.autocast():
            values = t.critic(mb, ctx.config.packing)
        (values.sum() * 0.0).backward()
