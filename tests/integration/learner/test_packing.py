"""Packed micro-batches train exactly as padded rows: the same losses and the same weights after training
steps (decoupled and bypass, GAE, activation checkpointing), with fewer forward passes."""

from __future__ import annotations

import pytest
import torch

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401
from tests.unit.learner.rl.test_microbatches import ragged_groups

pytestmark = pytest.mark.redis
STEPS = 2


def train(cfg, groups) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """`STEPS` learner steps on `groups`: the step losses, the weights, the decoder's forward passes."""
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg)
    calls: list[int] = []
    learner.model.model.norm.register_forward_hook(lambda *a: calls.append(1))
    try:
        losses = [learner.step()["loss"] for _ in range(STEPS)]
        return losses, {n: p.detach().clone() for n, p in learner.model.named_parameters()}, len(calls)
    finally:
        learner.close()


@pytest.mark.parametrize(
    ("preset", "extra"),
    [
        ("decoupled_token_is", {}),
        ("bypass_ppo_clip", {}),
        ("decoupled_token_is", {"adv_estimator": "gae", "critic": {"lr": 1e-3}}),
        ("decoupled_token_is", {"gradient_checkpointing": True}),
    ],
    ids=["decoupled", "bypass", "gae", "checkpointing"],
)
def test_packed_trains_like_padded_rows(preset, extra, tiny_dir, redis_url, tmp_path):  # noqa: F811
    groups = ragged_groups(4 * STEPS, 3, seed=11, prompt=(3, 30), response=(1, 40))
    runs = {}
    for packing in (False, True):
        cfg = config(
            tiny_dir, redis_url, tmp_path / str(packing), groups_per_step=4, mini_batch_groups=2,
            packing=packing, micro_batch_size=3, micro_batch_tokens=120, rollout_correction=preset,
            buffer={"sampler": "fifo", "max_times_sampled": 1}, checkpoint={"checkpoint_dir": None},
            optimizer={"lr": 1e-2}, **extra,
        )  # fmt: skip
        runs[packing] = train(cfg, groups)
    (pad_losses, pad_weights, _), (pack_losses, pack_weights, _) = runs[False], runs[True]
    assert pack_losses == pytest.approx(pad_losses, abs=1e-5)
    diff = max((pad_weights[n] - pack_weights[n]).abs().max().item() for n in pad_weights)
    assert diff <= 1e-5, f"packed vs padded weights differ by {diff}"
    initial = dict(load_model(tiny_dir, "cpu").named_parameters())
    moved = max((pack_weights[n] - initial[n].detach()).abs().max().item() for n in pack_weights)
    assert moved > 1e-3  # trained weights are compared, not the initial ones twice


@pytest.mark.parametrize(("packing", "budget", "passes"), [(False, 0, 8), (True, 10_000, 3), (True, 120, 9)])
def test_the_token_budget_sets_the_forward_passes(packing, budget, passes, tiny_dir, redis_url, tmp_path):  # noqa: F811
    """Per step (12 sequences of ~15-70 tokens, 2 mini-batches of 6): pi_old over all 12, then each
    mini-batch. Padded rows of 3: 4 + 2 x 2 passes; packed within 10,000 tokens: 1 + 1 + 1; within 120
    tokens: as many as the sequences need."""
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=4, mini_batch_groups=2, packing=packing,
        micro_batch_size=3, micro_batch_tokens=budget or 1, checkpoint={"checkpoint_dir": None},
        buffer={"sampler": "fifo", "max_times_sampled": 1},
    )  # fmt: skip
    *_, calls = train(cfg, ragged_groups(4 * STEPS, 3, seed=11, prompt=(3, 30), response=(1, 40)))
    assert calls == STEPS * passes
