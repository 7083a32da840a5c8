"""benchmarks/stale_actors.py: the pool eta versions behind hands the learner at step t the batch of step
t - eta (the initial ones first) and generates on demand with the weights of version t - eta, never the
learner's live ones; at eta 0 it is the identity (the synchronous loop of learning_signal.py)."""

from __future__ import annotations

import pytest
import torch

from stale_actors import StaleActors


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _train_one_step(model: torch.nn.Module, version: int) -> None:
    """A stand-in optimizer step: version v's weights are all v."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(version))


def test_handoff_is_a_delay_line_of_eta_batches_initial_first():
    pool = StaleActors(_model(), 2, ["init-old", "init-new"])
    handed = [pool.handoff(f"step-{t}") for t in range(5)]
    assert handed == ["init-old", "init-new", "step-0", "step-1", "step-2"]


def test_behind_generates_with_the_weights_of_version_t_minus_eta():
    model = _model()
    pool = StaleActors(model, 2)
    seen = []
    for t in range(6):
        _train_one_step(model, t)  # the learner's weights at version t
        pool.record(t)
        stale, version = pool.behind(t)
        assert stale is not model
        seen.append((version, stale.weight[0, 0].item(), stale.bias[0].item()))
    assert seen == [(0, 0.0, 0.0), (0, 0.0, 0.0), (0, 0.0, 0.0), (1, 1.0, 1.0), (2, 2.0, 2.0), (3, 3.0, 3.0)]
    assert model.weight[0, 0].item() == 5.0  # the live weights untouched by the snapshots
    assert sorted(pool._snapshots) == [3, 4, 5]  # the last eta + 1 versions only


def test_eta_zero_is_the_identity_and_copies_nothing():
    model = _model()
    pool = StaleActors(model, 0)
    assert pool.handoff("fresh") == "fresh"
    pool.record(7)
    assert pool.behind(7) == (model, 7) and pool._snapshots == {}


def test_a_version_never_recorded_or_a_wrong_start_is_refused():
    pool = StaleActors(_model(), 1, ["x"])
    with pytest.raises(KeyError, match="version 3"):
        pool.behind(4)
    with pytest.raises(ValueError, match="need exactly eta"):
        StaleActors(_model(), 2, ["only one"])
    with pytest.raises(ValueError, match="no delay line"):
        StaleActors(_model(), 2).handoff("fresh")  # snapshots only: no initial batches to hand
