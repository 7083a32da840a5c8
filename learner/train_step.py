"""One learner step's training, spec §5.1 in order: collate → [decoupled] pi_old once, the correction,
its mask replacing the response mask → advantages → PPO epochs × mini-batches (one optimizer step each,
learner/update.py) → the step's metrics. On N ranks every rank runs it on the same batch (its own share of
each mini-batch's groups); the loop around it is learner/train.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from learner.advantages import compute_advantages, gae, grpo
from learner.batching import Batch, collate, token_staleness
from learner.correction import compute_rollout_correction
from learner.critic import token_rewards
from learner.distributed import all_reduce_sum, reduce_means
from learner.metrics import StalenessKL
from learner.update import metric_sums, mini_batches, no_grad_logprobs, optimizer_step, rows_forward, timed

if TYPE_CHECKING:
    from learner.train import Learner


def train_on(learner: Learner, groups: list, phases: dict[str, float]) -> dict[str, float]:
    """Train on `groups` (this rank's share on N ranks): collate, pi_old and the correction, advantages,
    PPO epochs x mini-batches (one optimizer step each: `learner.version` += 1). Returns the step's
    metrics (host floats); `phases` gets the critical-path time of each phase."""
    cfg, rc = learner.config, learner.config.rollout_correction
    # --- collate
    with timed(phases, "collate"):
        batch = collate(groups, learner.pad_id).to(learner.device)
        staleness = learner.version - batch.policy_versions  # (B,)
        tokens = batch.response_mask.sum()
    host: dict[str, float] = {}
    kl = StalenessKL()
    # --- pi_old and the correction (decoupled: once per batch; its mask replaces the response mask)
    with timed(phases, "old_logprob"):
        if rc.bypass_mode:
            batch.old_log_probs = batch.rollout_log_probs
        else:
            batch.old_log_probs = no_grad_logprobs(
                learner.policy, batch, cfg, learner.precision, learner.ranks
            )
            ages = token_staleness(batch, learner.version)  # (B, R): each token's own age
            kl.add(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, ages)
            corr = compute_rollout_correction(
                batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, rc
            )
            batch.response_mask, batch.is_weights = corr.response_mask.float(), corr.weights
            host |= corr.metrics
        advantages(learner, batch)
    # --- PPO epochs × mini-batches × micro-batches
    acc: dict[str, list[torch.Tensor]] = {}
    order = torch.Generator().manual_seed(cfg.seed * 1_000_003 + learner.step_count)  # same on every rank
    for epoch in range(cfg.ppo_epochs):
        for mini in mini_batches(batch, cfg.mini_batch_groups, order):
            bypass_kl = (kl, learner.version) if epoch == 0 and rc.bypass_mode else None
            optimizer_step(
                learner.trainables(),
                batch,
                mini,
                cfg,
                acc,
                phases,
                learner.precision,
                bypass_kl,
                learner.persist.fence,
                learner.ranks,
            )
            learner.version += 1  # the policy version counts optimizer steps
    if learner.ranks.is_leader:  # the histograms are exported by rank 0 alone
        if batch.is_weights is not None:
            kept = batch.is_weights[batch.response_mask > 0]
            learner.metrics.is_weight_hist.observe_many(kept.cpu().numpy())
        learner.metrics.staleness_hist.observe_many(staleness.cpu().numpy())
    host |= reduce_means(learner.ranks, metric_sums(acc))  # means over every rank's micro-batches
    host["actor/pg_loss"] = host["loss"]
    if rc.bypass_mode:  # pi_theta's KL was taken on each rank's own rows
        kl.sums, kl.counts = (
            all_reduce_sum(learner.ranks, t.to(learner.device)) for t in (kl.sums, kl.counts)
        )
    host |= {f"offpolicy_kl/{b}": v for b, v in kl.result().items()}
    scalars = torch.stack([tokens, batch.rewards.mean(), staleness.float().mean()]).cpu().tolist()
    host |= {
        "tokens": scalars[0],
        "groups": float(len(groups)),
        "reward_mean": scalars[1],
        "staleness_mean": scalars[2],
        "response_length_mean": scalars[0] / batch.num_rows,
        "version": float(learner.version),
        "lr": learner.scheduler.get_last_lr()[0],
    }
    return host


def advantages(learner: Learner, batch: Batch) -> None:
    """`batch.advantages` (and, with GAE, `values` and `returns`) by the configured estimator."""
    cfg = learner.config
    if cfg.adv_estimator == "grpo":
        batch.advantages = grpo(
            batch.rewards, batch.group_index, batch.response_mask, norm_by_std=cfg.norm_adv_by_std_in_grpo
        )
        return
    if learner.critic is None:
        batch.advantages = compute_advantages(
            cfg.adv_estimator, batch.rewards, batch.group_index, batch.response_mask
        )
        return
    with torch.no_grad(), learner.precision.autocast():
        batch.values = rows_forward(learner.critic, batch, cfg.micro_batch_size, learner.ranks)  # (B, R)
    # The episode is every sampled token: the reward sits on the last one, whatever rejection sampling
    # masked out of the loss (`response_mask`); values and returns cover all sampled tokens.
    rewards = token_rewards(batch.rewards, batch.sampled_mask)  # (B, R)
    batch.advantages, batch.returns = gae(rewards, batch.values, batch.sampled_mask, cfg.gamma, cfg.lam)
    batch.advantages = batch.advantages * batch.response_mask  # the loss sees only kept tokens
