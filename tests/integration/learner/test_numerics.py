"""What the learner's update computes, on the tiny model and the embedded Redis: mixed precision keeps small
updates that pure bf16 loses, a PATCHed learning rate trains at once, GAE's reward sits on the last sampled
token whatever rejection sampling kept, and activation checkpointing recomputes the layers for the same
update."""

from __future__ import annotations

import pytest
import torch

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.batch import collate
from offpolicy.learner.rl.step import advantages
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, covering_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis


def moved_fraction(precision: str, tiny_dir, redis_url, tmp_path) -> float:  # noqa: F811
    cfg = config(
        tiny_dir, redis_url, tmp_path, precision=precision, optimizer={"lr": 1e-6}, groups_per_step=2,
        micro_batch_size=4, rollout_correction="bypass_ppo_clip", checkpoint={"checkpoint_dir": None},
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(covering_groups(20, seed=1))
    learner = Learner(cfg)
    try:
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        for _ in range(10):
            learner.step()
        moved = sum(int((p.detach() != before[n]).sum()) for n, p in learner.model.named_parameters())
        total = sum(p.numel() for p in before.values())
        dtype = next(learner.model.parameters()).dtype
    finally:
        learner.close()
    assert dtype == (torch.bfloat16 if precision == "bf16_pure" else torch.float32)
    return moved / total


def test_bf16_mixed_keeps_lr_1e_6_updates_that_bf16_pure_loses(tiny_dir, redis_url, tmp_path):  # noqa: F811
    """fp32 masters under bf16 autocast: >= 99 % of the weights move in 10 steps at lr 1e-6. Pure bf16:
    the updates are below bf16's rounding step at the weights' magnitude, and most are lost."""
    mixed = moved_fraction("bf16_mixed", tiny_dir, redis_url, tmp_path / "mixed")
    pure = moved_fraction("bf16_pure", tiny_dir, redis_url, tmp_path / "pure")
    print(f"moved: bf16_mixed {mixed:.4f}, bf16_pure {pure:.4f}")
    assert mixed >= 0.99, mixed
    assert pure < 0.5, pure


def test_a_patched_learning_rate_trains_the_next_step(tiny_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(tiny_dir, redis_url, tmp_path, optimizer={"lr": 1e-3}, checkpoint={"checkpoint_dir": None})
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(covering_groups(6, seed=2))
    learner = Learner(cfg)
    seen: list[float] = []
    learner.optimizer.register_step_pre_hook(lambda opt, args, kw: seen.append(opt.param_groups[0]["lr"]))
    try:
        learner.step()
        learner.apply_config(
            cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"lr": 2e-2})}), 1
        )
        metrics = learner.step()
    finally:
        learner.close()
    assert seen == [pytest.approx(1e-3), pytest.approx(2e-2)]
    assert metrics["lr"] == pytest.approx(2e-2)


def test_gae_puts_the_reward_on_the_last_sampled_token_not_the_last_kept_one(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    """gamma = lam = 1 and a zero-initialised critic (values 0): every sampled token's return is the
    reward, also where rejection sampling cleared the loss mask (the last token here)."""
    cfg = config(tiny_dir, redis_url, tmp_path, adv_estimator="gae", checkpoint={"checkpoint_dir": None})
    learner = Learner(cfg)
    try:
        groups = covering_groups(2, seed=3, n=2, tokens=5)
        batch = collate(groups, learner.pad_id)
        batch.response_mask = batch.response_mask.clone()
        batch.response_mask[:, -1] = 0.0  # what a token-level RS mask can do
        advantages(learner.step_context(), batch)
    finally:
        learner.close()
    torch.testing.assert_close(batch.returns, batch.rewards[:, None].expand(-1, 5), rtol=0, atol=1e-6)
    assert torch.all(batch.advantages[:, -1] == 0)  # the loss still sees only the kept tokens


def test_gradient_checkpointing_recomputes_the_layers_and_trains_the_same(tiny_dir, redis_url, tmp_path):  # noqa: F811
    """With `gradient_checkpointing` each decoder layer runs again in the backward pass (one more forward
    per micro-batch), and the update is the same as without it."""
    results = {}
    for gc in (False, True):
        cfg = config(
            tiny_dir, redis_url, tmp_path / str(gc), gradient_checkpointing=gc, groups_per_step=2,
            rollout_correction="bypass_ppo_clip", micro_batch_size=4, checkpoint={"checkpoint_dir": None},
        )  # fmt: skip
        with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
            buf.insert_many(covering_groups(2, seed=5))
        learner = Learner(cfg)
        calls: list[int] = []
        learner.model.model.layers[0].mlp.act_fn.register_forward_hook(
            lambda *a, calls=calls: calls.append(1)
        )
        try:
            learner.step()
            results[gc] = (len(calls), {n: p.detach().clone() for n, p in learner.model.named_parameters()})
        finally:
            learner.close()
    (plain_calls, plain), (gc_calls, checkpointed) = results[False], results[True]
    assert gc_calls == 2 * plain_calls  # bypass: one forward per micro-batch, recomputed once in backward
    for name, p in plain.items():
        torch.testing.assert_close(checkpointed[name], p, rtol=1e-5, atol=1e-7)
