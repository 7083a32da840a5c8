"""Packed micro-batches: the plan (token budget, lock-step balance) and the packed forward, which gives the
padded forward's log-probs, values and gradients with every attention kernel."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.model import ValueModel, load_model, make_tiny_model, token_logprobs
from offpolicy.learner.model.policy import pack
from offpolicy.learner.rl.microbatches import plan_micro_batches

VOCAB = 101


def ragged_groups(k: int, n: int, seed: int, prompt=(3, 12), response=(1, 20)) -> list[TrajectoryGroup]:
    """`k` groups of `n` completions, prompt and response lengths drawn uniformly from the ranges."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(k):
        trajs = []
        for j in range(n):
            r = int(rng.integers(response[0], response[1] + 1))
            trajs.append(
                Trajectory(
                    response_ids=rng.integers(4, VOCAB, r, dtype=np.int32),
                    behavior_logprobs=-(rng.random(r, dtype=np.float32) + 3.0),
                    reward=float(j % 2),
                    finish_reason="length",
                )
            )
        out.append(
            TrajectoryGroup(
                group_id=uuid.uuid4().hex,
                prompt_id=f"p{i}",
                prompt_ids=rng.integers(
                    4, VOCAB, int(rng.integers(prompt[0], prompt[1] + 1)), dtype=np.int32
                ),
                policy_version=0,
                actor_id="test",
                created_at=time.time(),
                sampling=SamplingParams(temperature=0.7 + 0.1 * i, max_tokens=response[1]),
                trajectories=trajs,
            )
        )
    return out


# --- the plan


def test_plan_keeps_every_micro_batch_within_the_budget_and_every_sequence_once():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 300, 97)]
    for world in (1, 2, 8):
        plan = plan_micro_batches(lengths, 600, world)
        counts = {len(p) for p in plan}
        assert len(counts) == 1  # every rank runs as many micro-batches
        flat = sorted(i for rank in plan for mb in rank for i in mb)
        assert flat == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= 600 for rank in plan for mb in rank)


def test_plan_uses_the_fewest_micro_batches_that_fit():
    assert plan_micro_batches([100] * 8, 400, 1) == [[[0, 2, 4, 6], [1, 3, 5, 7]]]
    assert len(plan_micro_batches([100] * 8, 800, 1)[0]) == 1


def test_a_sequence_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    plan = plan_micro_batches([5000, 10, 10, 10], 100, 1)
    assert [0] in plan[0]
    assert all(sum([5000, 10, 10, 10][i] for i in mb) <= 100 for mb in plan[0] if mb != [0])


def test_the_kth_micro_batches_of_the_ranks_are_balanced():
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in np.minimum(rng.lognormal(6.4, 0.8, 512), 8000)]  # long-tailed
    world = 8
    plan = plan_micro_batches(lengths, 16384, world)
    loads = [[sum(lengths[i] for i in mb) for mb in rank] for rank in plan]  # [rank][k]
    slowest = sum(max(loads[r][k] for r in range(world)) for k in range(len(loads[0])))
    assert sum(lengths) / (world * slowest) >= 0.9


def test_ranks_with_nothing_get_idle_passes():
    plan = plan_micro_batches([10, 20], 100, 4)
    assert [len(p) for p in plan] == [1, 1, 1, 1]
    assert sorted(len(p[0]) for p in plan) == [0, 0, 1, 1]


# --- the packed forward


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_pack_concatenates_real_tokens_with_restarting_positions():
    batch = collate(ragged_groups(2, 2, seed=3), pad_token_id=0)
    p = pack(batch)
    lengths = batch.attention_mask.sum(-1).tolist()
    assert p.input_ids.shape == (1, sum(lengths))
    assert p.kwargs["packed_seq_lens"].tolist() == lengths
    starts = np.cumsum([0, *lengths[:-1]])
    assert (p.position_ids[0, starts] == 0).all()
    assert p.predictors.numel() == int(batch.sampled_mask.sum())
    # the state predicting each row's first response token is that row's last prompt token
    first = p.input_ids[0, p.predictors[0]]
    row0_prompt = batch.input_ids[0][batch.attention_mask[0].bool()][
        : int(batch.attention_mask[0].sum()) - int(batch.sampled_mask[0].sum())
    ]
    assert first == row0_prompt[-1]


@pytest.mark.parametrize("attn", ["sdpa_varlen", "sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny, attn):
    model = load_model(tiny, "cpu", torch.float32, attn_implementation=attn)
    batch = collate(ragged_groups(3, 3, seed=4), pad_token_id=0)
    batch.response_mask = batch.response_mask.clone()
    batch.response_mask[1, 0] = 0.0  # a token rejection sampling cleared

    def run(packed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        lp = token_logprobs(model, batch, chunk_tokens=7, packed=packed)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    padded, g_padded = run(False)
    packed, g_packed = run(True)
    assert packed.shape == padded.shape
    assert (packed - padded).abs().max() <= 1e-5
    assert packed[1, 0] == 0 and (packed[batch.sampled_mask == 0] == 0).all()
    assert max((a - b).abs().max().item() for a, b in zip(g_padded, g_packed, strict=True)) <= 1e-5


def test_packed_values_equal_the_padded_ones(tiny):
    critic = ValueModel(tiny, "cpu", torch.float32, attn_implementation="sdpa_varlen")
    torch.nn.init.normal_(critic.head.weight)  # a zero head would hide any difference
    batch = collate(ragged_groups(2, 3, seed=5), pad_token_id=0)
    with torch.no_grad():
        padded, packed = critic(batch, packed=False), critic(batch, packed=True)
    assert (packed - padded).abs().max() <= 1e-5
    assert (packed[batch.sampled_mask == 0] == 0).all()


def test_an_idle_pass_packs_to_no_sampled_token_and_still_runs_backward(tiny):
    model = load_model(tiny, "cpu", torch.float32, attn_implementation="sdpa_varlen")
    batch = collate(ragged_groups(1, 1, seed=6), pad_token_id=0)
    batch.sampled_mask = batch.sampled_mask * 0
    batch.response_mask = batch.response_mask * 0
    lp = token_logprobs(model, batch, chunk_tokens=16, packed=True)
    (lp.sum() * 0.0).backward()
    assert (lp == 0).all()
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.parameters())


def test_pi_old_runs_in_inference_mode_on_one_process_and_the_loss_can_use_it(tiny):
    """`rows_forward` runs each pass in inference mode on one process, under no_grad on N ranks (FSDP2's
    all-gather buffers), and returns a normal tensor: the loss may save it for its backward pass."""
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.distributed.ranks import SINGLE, Ranks
    from offpolicy.learner.rl.microbatches import grad_off, rows_forward

    batch = collate(ragged_groups(2, 2, seed=4), 0)
    cfg = LearnerConfig(model_path="unused", micro_batch_tokens=256)
    seen = []

    def fn(mb):
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return token_logprobs(model, mb, packed=True)

    model = load_model(tiny, "cpu")
    out = rows_forward(fn, batch, cfg, SINGLE)
    assert seen and all(mode == (True, False) for mode in seen)
    assert not out.is_inference() and not out.requires_grad
    w = torch.ones((), requires_grad=True)
    (w * out).sum().backward()  # `out` saved for the backward pass: an inference tensor could not be
    assert w.grad is not None
    with grad_off(Ranks(0, 2, 0, control=object())):
        assert torch.is_grad_enabled() is False and not torch.is_inference_mode_enabled()
