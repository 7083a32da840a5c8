"""One learner step's training, spec §5.1 in order: collate → [decoupled] pi_old once, the correction,
its mask replacing the response mask → advantages → [KL loss] the reference's log-probs → [distillation]
the teacher's log-probs, the distillation term in the advantages (rl/advantages.py `distill`) → PPO epochs ×
mini-batches (one optimizer step each, rl/update.py) → the step's metrics. On N ranks every rank runs it
on the same batch (its own share of each mini-batch's groups). The trainer (learner/trainer.py) calls
`train_on` with a frozen `StepContext` and advances its own version by the optimizer steps it reports.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from offpolicy.learner.batch import Batch, collate, token_staleness
from offpolicy.learner.correction import compute_rollout_correction
from offpolicy.learner.distributed.ranks import all_reduce_sum, reduce_means
from offpolicy.learner.errors import BatchError
from offpolicy.learner.metrics import metric_sums, timed
from offpolicy.learner.model.vision import Pixels, process_images
from offpolicy.learner.rl import routing
from offpolicy.learner.rl.advantages import compute_advantages, distill, gae, grpo, token_rewards
from offpolicy.learner.rl.context import StepContext, StepResult
from offpolicy.learner.rl.dynamic_sampling import truncated_rows
from offpolicy.learner.rl.microbatches import (
    mini_batches,
    no_grad_logprobs,
    no_grad_logprobs_entropy,
    rows_forward,
)
from offpolicy.learner.rl.priorities import group_is_deviation, row_weights
from offpolicy.learner.rl.staleness_kl import RoutingByStaleness, StalenessKL
from offpolicy.learner.rl.update import optimizer_step


def train_on(
    ctx: StepContext, groups: list, phases: dict[str, float], images: Mapping[str, bytes] | None = None
) -> StepResult:
    """Train on `groups` (this rank's share on N ranks): collate, pi_old and the correction, advantages,
    PPO epochs x mini-batches (one optimizer step each). Returns the step's metrics (host floats) and its
    optimizer steps (the policy version advances by as many); `phases` gets the critical-path time of each
    phase. `images`: the bytes of the images the groups show (sha256 -> bytes; a vision-language policy)."""
    cfg, rc = ctx.config, ctx.config.rollout_correction
    # --- collate
    with timed(phases, "collate"):
        batch = collate(groups, ctx.pad_id, pixels_of(ctx, groups, images)).to(ctx.device)
        if cfg.screening.overlong == "filter":  # no loss on truncated completions (dynamic_sampling.py)
            kept = ~truncated_rows(groups).to(ctx.device)  # (B,)
            batch.response_mask = batch.response_mask * kept.unsqueeze(-1)  # (B, R)
        routing.choose(cfg, batch)  # MoE routing replay: the rollout's choices (R3), or pi_old's below (R2)
        staleness = ctx.version - batch.policy_versions  # (B,)
        tokens = batch.response_mask.sum()
    host: dict[str, float] = {}
    old_entropy: torch.Tensor | None = None  # pi_old's token-mean entropy (decoupled, not R2)
    kl = StalenessKL()
    moe_policy = getattr(ctx.trainables.policy, "router", None) is not None
    routing_ages = RoutingByStaleness() if moe_policy else None
    # --- pi_old and the correction (decoupled: once per batch; its mask replaces the response mask)
    with timed(phases, "old_logprob"):
        if rc.bypass_mode:
            batch.old_log_probs = batch.behavior_logprobs
        else:
            if cfg.moe.routing_replay == "old":  # R2: pi_old routes freely, the update replays its choices
                batch.old_log_probs, batch.replay_experts = routing.old_pass(
                    ctx.trainables.policy, batch, cfg, ctx.precision, ctx.ranks
                )
            else:  # the entropy from the same pass, every step (verl's `actor/entropy`)
                batch.old_log_probs, entropy = no_grad_logprobs_entropy(
                    ctx.trainables.policy, batch, cfg, ctx.precision, ctx.ranks
                )
                mask = batch.response_mask  # (B, R) before the correction's mask replaces it
                old_entropy = (entropy * mask).sum() / mask.sum().clamp(min=1.0)  # read with the scalars
            ages = token_staleness(batch, ctx.version)  # (B, R): each token's own age
            kl.add(batch.old_log_probs, batch.behavior_logprobs, batch.response_mask, ages)
            corr = compute_rollout_correction(
                batch.old_log_probs, batch.behavior_logprobs, batch.response_mask, rc
            )
            batch.response_mask, batch.is_weights = corr.response_mask.float(), corr.weights
            host |= corr.metrics
        advantages(ctx, batch)
    if ctx.reference is not None:  # the KL loss: the reference's log-probs on the same micro-batches
        with timed(phases, "ref_logprob"):
            batch.ref_log_probs = no_grad_logprobs(ctx.reference, batch, cfg, ctx.precision, ctx.ranks)
    if ctx.teacher is not None:  # on-policy distillation: the teacher scores each sampled token
        with timed(phases, "teacher_logprob"):
            batch.teacher_log_probs = no_grad_logprobs(ctx.teacher, batch, cfg, ctx.precision, ctx.ranks)
        tc = cfg.teacher
        batch.advantages, reverse_kl = distill(
            batch.advantages, batch.old_log_probs, batch.teacher_log_probs, batch.response_mask,
            tc.reward_weight, tc.task_reward_weight,
        )  # fmt: skip
        host["distill/reverse_kl"] = float(reverse_kl)
    # prioritized replay (`priorities.beta`): each group's importance weight undoes its sampling bias
    batch.advantages = batch.advantages * row_weights(groups).to(ctx.device).unsqueeze(-1)  # (B, R)
    # --- PPO epochs × mini-batches × micro-batches
    acc: dict[str, list[torch.Tensor]] = {}
    order = torch.Generator().manual_seed(cfg.seed * 1_000_003 + ctx.step_count)  # same on every rank
    steps = skipped = 0  # optimizer steps (skipped ones too): the policy version is ctx.version + steps
    for epoch in range(cfg.ppo_epochs):
        for mini in mini_batches(batch, cfg.mini_batch_groups, order):
            bypass_kl = (kl, ctx.version + steps) if epoch == 0 and rc.bypass_mode else None
            skipped += not optimizer_step(ctx, batch, mini, acc, phases, bypass_kl, routing_ages)
            steps += 1
    if ctx.metrics is not None:  # the histograms are exported by rank 0 alone
        if batch.is_weights is not None:
            kept = batch.is_weights[batch.response_mask > 0]
            ctx.metrics.is_weight_hist.observe_many(kept.cpu().numpy())
        ctx.metrics.staleness_hist.observe_many(staleness.cpu().numpy())
    host |= reduce_means(ctx.ranks, metric_sums(acc))  # means over every rank's micro-batches
    if rc.bypass_mode:  # pi_theta's KL was taken on each rank's own rows
        kl.sums, kl.counts = (all_reduce_sum(ctx.ranks, t.to(ctx.device)) for t in (kl.sums, kl.counts))
    host |= {f"offpolicy_kl/{b}": v for b, v in kl.result().items()}
    if routing_ages is not None:  # each rank's own micro-batches: summed over ranks (every rank an MoE)
        summed = all_reduce_sum(ctx.ranks, torch.stack([x.to(ctx.device) for x in routing_ages.tensors()]))
        routing_ages.set_tensors(list(summed))  # one all-reduce of (4, buckets)
        host |= routing_ages.result()
    tail = [] if old_entropy is None else [old_entropy.float()]
    scalars = torch.stack([tokens, batch.rewards.mean(), staleness.float().mean(), *tail]).cpu().tolist()
    if old_entropy is not None and "actor/entropy" not in host:  # the update's own (entropy_coeff > 0) wins
        host["actor/entropy"] = scalars[3]
    host |= {
        "tokens": scalars[0],
        "groups": float(len(groups)),
        "reward_mean": scalars[1],
        "staleness_mean": scalars[2],
        "response_length_mean": scalars[0] / batch.num_rows,
        "version": float(ctx.version + steps),
        "optimizer_steps_skipped": float(skipped),
        "lr": ctx.trainables.scheduler.get_last_lr()[0],
    }
    deviation: tuple[float, ...] = ()  # per group, for the priority written back (`priorities.update`)
    if cfg.priorities.update:  # mean |log pi_old - log mu| (rl/priorities.py); 0 in bypass mode
        log_ratio = batch.old_log_probs - batch.behavior_logprobs  # (B, R)
        deviation = tuple(group_is_deviation(log_ratio, batch.response_mask, batch.group_index))
    return StepResult(host, steps, deviation)


def pixels_of(ctx: StepContext, groups: list, images: Mapping[str, bytes] | None) -> Pixels | None:
    """The processed images of the groups that show any (None: none does); a policy without an image
    processor (not a vision-language model) refuses them (`BatchError`)."""
    shas = [sha for g in groups for sha in g.images]
    if not shas:
        return None
    if ctx.image_processor is None:
        raise BatchError(
            f"groups show {len(set(shas))} image(s), and the policy is not a vision-language model"
        )
    return process_images(ctx.image_processor, images or {}, shas)


def advantages(ctx: StepContext, batch: Batch) -> None:
    """`batch.advantages` (and, with GAE, `values` and `returns`) by the configured estimator."""
    cfg, critic = ctx.config, ctx.trainables.critic
    if cfg.adv_estimator == "grpo":
        batch.advantages = grpo(
            batch.rewards, batch.group_index, batch.response_mask, norm_by_std=cfg.norm_adv_by_std_in_grpo
        )
        return
    if critic is None:
        batch.advantages = compute_advantages(
            cfg.adv_estimator, batch.rewards, batch.group_index, batch.response_mask
        )
        return
    with torch.no_grad(), ctx.precision.autocast():
        batch.values = rows_forward(lambda mb: critic(mb, cfg.packing), batch, cfg, ctx.ranks)  # (B, R)
    # The episode is every sampled token: the reward sits on the last one, whatever rejection sampling
    # masked out of the loss (`response_mask`); values and returns cover all sampled tokens.
    rewards = token_rewards(batch.rewards, batch.sampled_mask)  # (B, R)
    batch.advantages, batch.returns = gae(rewards, batch.values, batch.sampled_mask, cfg.gamma, cfg.lam)
    batch.advantages = batch.advantages * batch.response_mask  # the loss sees only kept tokens
