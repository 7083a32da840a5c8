"""A tiny Qwen3-MoE on 2 ranks (torchrun, FSDP2, gloo on CPU) with the router z-loss on trains like one
process: the same weights, loss and `moe/z_loss` (each micro-batch's z-loss weighted by its share of the
global mini-batch's tokens, summed over ranks: the mini-batch's token mean however it is split). The
load-balancing loss is a per-micro-batch loss (a product of means): its value depends on the split, so it
is compared loosely."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from offpolicy.learner.model import load_model, make_tiny_moe_model
from tests.integration.learner.distributed.test_fsdp import TOLERANCE, make_config, one_then_two
from tests.integration.learner.test_loop import make_groups

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def moe2(tmp_path_factory):
    return make_tiny_moe_model(
        tmp_path_factory.mktemp("moe2") / "model", hidden_size=64, num_heads=1, num_layers=2,
        moe_intermediate_size=32,
    )  # fmt: skip


@pytest.fixture(scope="module")
def moe_groups(moe2):
    behaviour = load_model(moe2, "cpu").eval()
    out = []
    for i, tokens in enumerate((4, 9, 6, 3)):
        out += make_groups(behaviour, 3, version=0, tokens=tokens, temperature=0.9, seed=i)
    for g in out:  # reward the share of even ids: the groups teach something
        g.trajectories = [replace(t, reward=float(np.mean(t.response_ids % 2 == 0))) for t in g.trajectories]
    return out


def test_two_ranks_train_an_moe_policy_with_the_z_loss_like_one_process(
    moe2, moe_groups, redis_url, tmp_path
):
    kw = {"moe": {"z_loss_coef": 0.05}, "optimizer": {"lr": 1e-3}}
    one = make_config(moe2, redis_url, tmp_path, "one", **kw)
    two = make_config(moe2, redis_url, tmp_path, "two", **kw)
    expected, _, got = one_then_two(one, two, moe_groups, redis_url, tmp_path)
    assert sorted(got) == sorted(expected)
    assert max(float((got[k] - v).abs().max()) for k, v in expected.items()) <= TOLERANCE
    lines = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("one", "two")
    }
    for key in ("moe/z_loss", "loss", "grad_norm"):
        want = [m[key] for m in lines["one"]]
        assert [m[key] for m in lines["two"]] == pytest.approx(want, rel=1e-4, abs=1e-7), key
    want = [m["moe/aux_loss"] for m in lines["one"]]  # other micro-batches: near, not equal
    assert [m["moe/aux_loss"] for m in lines["two"]] == pytest.approx(want, rel=1e-2)
