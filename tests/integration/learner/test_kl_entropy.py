"""The KL-to-reference loss and the entropy bonus change what the learner does: on the same groups, in the
same order, with the same seeds, a few steps at a high learning rate end closer to the reference with
`kl_loss_coef > 0` than without, and with a higher entropy with `entropy_coeff > 0` than without. The
reference is loaded only with the KL loss; `actor/kl_loss` and `actor/entropy` reach the step's metrics,
the JSONL line and /metrics; pi_old's entropy is logged at every step whatever `entropy_coeff`."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.batch import collate
from offpolicy.learner.model import load_model
from offpolicy.learner.model.policy import token_stats
from offpolicy.learner.rl.losses import kl_penalty
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import behaviour, config, make_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis
STEPS = 4


@pytest.fixture(scope="module")
def groups(behaviour):  # noqa: F811
    """16 groups of 4 from the initial policy; reward = the share of even token ids (the untrained model
    never samples the loop's target token, and this one varies within a group)."""
    out = make_groups(behaviour, 4 * STEPS, version=0, temperature=1.0, seed=5)
    for g in out:
        g.trajectories = [replace(t, reward=float(np.mean(t.response_ids % 2 == 0))) for t in g.trajectories]
    return out


def train(tiny_dir, redis_url, tmp_path, groups, **kw):  # noqa: F811
    """STEPS learner steps on `groups` (each used once, FIFO): (the step metrics, the trained model, the
    learner's reference, its /metrics registry)."""
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=4, optimizer={"lr": 3e-2},
        buffer={"sampler": "fifo", "max_times_sampled": 1}, checkpoint={"checkpoint_dir": None},
        metrics_jsonl=str(tmp_path / "m.jsonl"), **kw,
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    registry = CollectorRegistry()
    learner = Learner(cfg, registry)
    try:
        steps = [learner.step() for _ in range(STEPS)]
        return steps, learner.model, learner.reference, registry
    finally:
        learner.close()


def measure(model, reference, groups) -> tuple[float, float]:
    """(k3 KL(policy || reference), the policy's entropy), token means over the groups' responses."""
    batch = collate(groups, pad_token_id=0)
    with torch.no_grad():
        lp, ent = token_stats(model, batch, entropy=True)
        ref, _ = token_stats(reference, batch)
    mask = batch.response_mask
    kl = (kl_penalty(lp, ref, "k3") * mask).sum() / mask.sum()
    return float(kl), float((ent * mask).sum() / mask.sum())


def test_the_kl_loss_keeps_the_policy_closer_to_the_reference(tiny_dir, groups, redis_url, tmp_path):  # noqa: F811
    initial = load_model(tiny_dir, "cpu").eval()
    free, model, reference, _ = train(tiny_dir, redis_url, tmp_path / "free", groups)
    assert reference is None  # kl_loss_coef 0: nothing loaded
    kl_free, _ = measure(model.eval(), initial, groups)
    held, model, reference, registry = train(
        tiny_dir, redis_url, tmp_path / "kl", groups, kl_loss_coef=1.0, kl_loss_type="low_var_kl"
    )
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    kl_held, _ = measure(model.eval(), initial, groups)
    print(
        f"KL(policy || initial) after {STEPS} steps: {kl_free:.4f} without, {kl_held:.4f} with kl_loss_coef 1"
    )
    assert kl_free > 0.02  # the policy did move
    assert kl_held < 0.5 * kl_free
    assert held[0]["actor/kl_loss"] == pytest.approx(
        0.0, abs=1e-7
    )  # the first update starts at the reference
    assert held[-1]["actor/kl_loss"] > 0 and "actor/kl_loss" not in free[-1]
    assert held[-1]["loss"] != pytest.approx(held[-1]["actor/pg_loss"])  # the KL term is in the loss
    line = json.loads((tmp_path / "kl" / "m.jsonl").read_text().splitlines()[-1])
    assert line["actor/kl_loss"] == pytest.approx(held[-1]["actor/kl_loss"])
    gauge = registry.get_sample_value("offpolicy_learner_actor_kl_loss")
    assert gauge == pytest.approx(held[-1]["actor/kl_loss"])


def test_the_entropy_bonus_keeps_the_entropy_higher(tiny_dir, groups, redis_url, tmp_path):  # noqa: F811
    free, model, _, _ = train(tiny_dir, redis_url, tmp_path / "free", groups)
    _, ent_free = measure(model.eval(), model, groups)
    bonus, model, _, registry = train(tiny_dir, redis_url, tmp_path / "bonus", groups, entropy_coeff=0.5)
    _, ent_bonus = measure(model.eval(), model, groups)
    print(f"entropy after {STEPS} steps: {ent_free:.4f} without, {ent_bonus:.4f} with entropy_coeff 0.5")
    assert ent_bonus > ent_free + 0.05
    # entropy_coeff 0: no bonus, but pi_old's entropy is logged every step from its own pass (as verl's
    # actor/entropy), the first step's that of the initial policy on the first 4 groups
    assert all("actor/entropy" in m for m in free)
    initial = load_model(tiny_dir, "cpu").eval()
    assert free[0]["actor/entropy"] == pytest.approx(measure(initial, initial, groups[:4])[1], rel=1e-5)
    assert free[-1]["actor/entropy"] != pytest.approx(free[0]["actor/entropy"])  # the policy moved
    assert bonus[-1]["loss"] < bonus[-1]["actor/pg_loss"]  # the bonus is subtracted
    gauge = registry.get_sample_value("offpolicy_learner_actor_entropy")
    assert gauge == pytest.approx(bonus[-1]["actor/entropy"])
