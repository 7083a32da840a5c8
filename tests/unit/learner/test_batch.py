"""collate's padded layout, and token_logprobs against a plain per-row forward at temperature T."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.errors import BatchError
from offpolicy.learner.model import load_model, make_tiny_model
from offpolicy.learner.model.policy import token_logprobs

PAD = 0


def _traj(ids, lps, reward=1.0, versions=None):
    return Trajectory(
        response_ids=np.asarray(ids, dtype=np.int32),
        behavior_logprobs=np.asarray(lps, dtype=np.float32),
        reward=reward,
        finish_reason="stop",
        versions=None if versions is None else np.asarray(versions, dtype=np.int32),
    )


def _group(prompt, trajs, version=0, temperature=1.0):
    return TrajectoryGroup(
        group_id=f"g{len(prompt)}{version}",
        prompt_id="p",
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        policy_version=version,
        actor_id="a",
        created_at=0.0,
        sampling=SamplingParams(temperature=temperature),
        trajectories=trajs,
    )


@pytest.fixture(scope="module")
def groups():
    return [
        _group([5, 6], [_traj([7, 8, 9], [-1, -2, -3], 1.0), _traj([10], [-0.5], 0.0)], version=3),
        _group(
            [11, 12, 13], [_traj([14, 15], [-0.25, -0.75], 0.5, versions=[4, 5])], version=4, temperature=0.5
        ),
    ]


def test_collate_layout(groups):
    b = collate(groups, PAD)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [
        [0, 5, 6, 7, 8, 9],
        [0, 5, 6, 10, 0, 0],
        [11, 12, 13, 14, 15, 0],
    ]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert b.position_ids.tolist() == [[0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 4]]
    assert b.response_ids.tolist() == [[7, 8, 9], [10, 0, 0], [14, 15, 0]]
    assert b.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert b.behavior_logprobs.tolist() == [[-1, -2, -3], [-0.5, 0, 0], [-0.25, -0.75, 0]]
    assert b.rewards.tolist() == [1.0, 0.0, 0.5]
    assert b.group_index.tolist() == [0, 0, 1]
    assert b.policy_versions.tolist() == [3, 3, 4]
    assert b.versions.tolist() == [[3, 3, 3], [3, 0, 0], [4, 5, 0]]
    assert b.temperatures.tolist() == [1.0, 1.0, 0.5]


def test_select_trims_padding_columns(groups):
    b = collate(groups, PAD).select(torch.tensor([1]))
    assert b.prompt_width == 2
    assert b.input_ids.tolist() == [[5, 6, 10]]
    assert b.response_mask.tolist() == [[1]]
    assert b.versions.tolist() == [[3]]


def test_collate_rejects_bad_groups(groups):
    with pytest.raises(BatchError, match="at least one group"):
        collate([], PAD)
    with pytest.raises(BatchError, match=r"temperature 0\.0"):
        collate([_group([1], [_traj([2], [-1.0])], temperature=0.0)], PAD)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny")), device="cpu").eval()


def test_token_logprobs_match_plain_forward(tiny, groups):
    b = collate(groups, PAD)
    with torch.no_grad():
        got = token_logprobs(tiny, b)  # (B, R)
        for row, (g, t) in enumerate(
            [
                (groups[0], groups[0].trajectories[0]),
                (groups[0], groups[0].trajectories[1]),
                (groups[1], groups[1].trajectories[0]),
            ]
        ):
            seq = torch.tensor(np.concatenate([g.prompt_ids, t.response_ids]), dtype=torch.long)[None]
            logits = tiny(input_ids=seq).logits[0] / g.sampling.temperature  # (L, V)
            p, r = len(g.prompt_ids), len(t.response_ids)
            want = torch.log_softmax(logits[p - 1 : p + r - 1], -1).gather(-1, seq[0, p:, None]).squeeze(-1)
            torch.testing.assert_close(got[row, :r], want, atol=1e-5, rtol=0)
            assert torch.all(got[row, r:] == 0)


def test_token_logprobs_of_a_selection_match_the_full_batch(tiny, groups):
    b = collate(groups, PAD)
    with torch.no_grad():
        full = token_logprobs(tiny, b)
        part = token_logprobs(tiny, b.select(torch.tensor([1, 2])))
    torch.testing.assert_close(part, full[1:, : part.shape[1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 4])
def test_chunked_logprobs_and_their_gradients_equal_the_unchunked_ones(tiny, groups, chunk_tokens):
    """The LM head on chunks of response positions (recomputed in backward) gives the same log-probs and
    the same gradients as one pass over the whole micro-batch (B = 3 rows, R = 3 columns)."""
    b = collate(groups, PAD)
    weights = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.0, 0.0], [-0.7, 0.4, 0.0]])

    def run(chunk):
        tiny.zero_grad(set_to_none=True)
        lp = token_logprobs(tiny, b, chunk_tokens=chunk)  # (B, R)
        (lp * weights).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in tiny.named_parameters()}

    whole_lp, whole_grad = run(10_000)
    lp, grad = run(chunk_tokens)
    torch.testing.assert_close(lp, whole_lp, atol=1e-6, rtol=0)
    for name, g in whole_grad.items():
        torch.testing.assert_close(grad[name], g, atol=1e-6, rtol=1e-5)
    tiny.zero_grad(set_to_none=True)


def test_staleness_counts_from_each_completions_oldest_token():
    from offpolicy.learner.batch import staleness, token_staleness

    g = _group(
        [1, 2],
        [_traj([3, 4, 5], [-1, -1, -1], versions=[6, 6, 7]), _traj([6, 7], [-1, -1], versions=[7, 7])],
        version=6,
    )
    b = collate([g, _group([1], [_traj([2], [-1])], version=5)], PAD)
    assert b.policy_versions.tolist() == [6, 7, 5]
    assert staleness(b, 8).tolist() == [2, 1, 3]
    ages = token_staleness(b, 8) * b.response_mask.long()  # padding masked out
    assert ages.tolist() == [[2, 2, 1], [1, 1, 0], [3, 0, 0]]


def test_staleness_kl_buckets_tokens_by_their_own_age():
    from offpolicy.learner.rl.staleness_kl import StalenessKL

    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    train = torch.tensor([[-1.5, -2.5, -2.0], [-0.5, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ages = torch.tensor([[2, 2, 1], [0, 0, 0]])
    kl = StalenessKL()
    kl.add(train, rollout, mask, ages)
    assert kl.result() == pytest.approx({"0": (-0.5 + 1.0) / 2, "1": -1.0, "2-3": (0.5 + 0.5) / 2})
    per_row = StalenessKL()  # (B,) staleness: every token of a row in the row's bucket, as before
    per_row.add(train, rollout, mask, torch.tensor([2, 0]))
    assert per_row.result() == pytest.approx({"0": 0.25, "2-3": 0.0})


def test_moe_routing_by_staleness_reaches_the_labelled_gauges():
    """An MoE step's router agreement counts the positions with routed rows, its log-prob gap every response
    token, each in its tokens' staleness bucket; the learner exports both as gauges labelled by bucket."""
    from prometheus_client import CollectorRegistry

    from offpolicy.learner.metrics import LearnerMetrics
    from offpolicy.learner.rl.staleness_kl import RoutingByStaleness

    agreement = torch.tensor([[1.0, 0.5, 0.0], [0.25, 1.0, 1.0]])  # share of layers agreeing per token
    rows = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # (0, 2): no routed row
    gap = torch.tensor([[0.1, 0.3, 0.5], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # (1, 2): not a response token
    ages = torch.tensor([[0, 0, 0], [5, 5, 5]])
    routing = RoutingByStaleness()
    routing.add(agreement, rows, gap, mask, ages)
    out = routing.result()
    assert out == pytest.approx({
        "moe/router_agreement/0": 0.75, "moe/router_agreement/4-7": (0.25 + 1.0) / 2,
        "moe/logprob_gap/0": 0.3, "moe/logprob_gap/4-7": 0.3,
    })  # fmt: skip
    registry = CollectorRegistry()
    LearnerMetrics(registry).record_step(out | {"moe/router_agreement": 0.7}, {})
    value = registry.get_sample_value
    assert value("offpolicy_learner_moe_router_agreement_by_staleness", {"staleness": "4-7"}) == 0.625
    assert value("offpolicy_learner_moe_logprob_gap_by_staleness", {"staleness": "0"}) == pytest.approx(0.3)
    assert value("offpolicy_learner_moe_router_agreement") == 0.7
