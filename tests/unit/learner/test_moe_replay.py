"""Routing replay (moe.routing_replay, model/moe.py `RouterLogits`): replaying the model's own choices is
exact, other choices change the outputs while the router still gets gradients, the agreement counts, and a
group without routed experts is refused under `rollout`."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.config.moe import MoeConfig
from offpolicy.learner.distributed.ranks import SINGLE
from offpolicy.learner.model import make_tiny_moe_model, moe
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision
from offpolicy.learner.rl import routing
from offpolicy.learner.rl.screening import ModelLimits, screen


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_moe_model(tmp_path_factory.mktemp("moe"), num_experts=4, experts_per_token=2)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    moe.select_experts(m, torch.device("cpu"))
    return m


def _run(model, router, ids, routes=None, replay=False, record=False):
    router.set_routes(routes, replay)
    with router.counting(record):
        logits = model(input_ids=ids).logits  # (1, T, V)
    return logits, router.agreement, router.record


def test_replay_own_choices_is_exact_and_agrees(model):
    router = moe.RouterLogits(model)
    try:
        ids = torch.randint(0, 50, (1, 12))
        free, _, own = _run(model, router, ids, record=True)
        routes = torch.stack(own, 1).long()  # (T, L, K): the model's own choices
        replayed, agree, _ = _run(model, router, ids, routes, replay=True)
        assert torch.equal(free, replayed)
        assert agree[0] == agree[1] == 12 * len(router.routers)  # agreement 1.0
    finally:
        router.remove()


def test_forced_routes_change_outputs_and_router_learns(model):
    router = moe.RouterLogits(model)
    try:
        ids = torch.randint(0, 50, (1, 12))
        free, _, own = _run(model, router, ids, record=True)
        own = torch.stack(own, 1).long()  # (T, L, K)
        g = torch.Generator().manual_seed(0)
        forced = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12 * own.shape[1])])
        forced = forced.view(own.shape)
        forced[:3] = -1  # the first tokens route freely
        model.zero_grad()
        out, agree, _ = _run(model, router, ids, forced, replay=True)
        assert not torch.allclose(out, free)
        assert torch.allclose(out[:, :3], free[:, :3], atol=1e-5)  # free tokens before any forced one
        assert 0 < agree[1] == 9 * own.shape[1] and agree[0] < agree[1]  # agreement < 1
        out.logsumexp(-1).sum().backward()
        for r in router.routers:
            assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    finally:
        router.set_routes(None, False)
        router.remove()


def test_replay_changes_gradients(model):
    """What `routing_replay` switches: with the same routes given, replay on vs off differ in gradients."""
    router = moe.RouterLogits(model)
    try:
        ids = torch.randint(0, 50, (1, 10))
        _, _, own = _run(model, router, ids, record=True)
        forced = (torch.stack(own, 1).long() + 1) % 4  # (T, L, K): other experts everywhere
        grads = []
        for replay in (False, True):
            model.zero_grad()
            out, _, _ = _run(model, router, ids, forced, replay=replay)
            out.logsumexp(-1).sum().backward()
            grads.append(router.routers[0].weight.grad.clone())
        assert not torch.allclose(grads[0], grads[1])
    finally:
        router.set_routes(None, False)
        router.remove()


def test_dense_policy_refuses_replay(tmp_path):
    from offpolicy.learner.model import make_tiny_model

    m = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path), dtype=torch.float32)
    with pytest.raises(ValueError, match="routing_replay"):
        moe.prepare(m, torch.device("cpu"), MoeConfig(routing_replay="rollout"), "tiny")


def test_group_without_routed_experts_is_refused(make_group):
    routed = make_group()
    for t in routed.trajectories:
        object.__setattr__(t, "routed_experts", np.zeros((len(t.response_ids), 2, 2), np.uint8))
    bare = make_group()
    limits = ModelLimits(vocab_size=10_000, max_positions=10_000, routed=(2, 2))
    good, bad = screen([routed, bare], limits)
    assert good == [routed]
    assert [(r.group.group_id, r.field) for r in bad] == [(bare.group_id, "trajectories[0].routed_experts")]
    assert screen([bare], ModelLimits(vocab_size=10_000, max_positions=10_000))[1] == []  # off: trained


# --- through the batch: collate, LogProbs, the step's choice of routes


def _groups(seed: int = 0, routed: bool = True, layers: int = 2, top_k: int = 2, experts: int = 4) -> list:
    """Two groups of two completions (prompts and responses of different lengths: padding in both), with
    random routed experts."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(2):
        trs = []
        for j in range(2):
            n = 6 - j - i
            rows = np.stack([rng.permutation(experts)[:top_k] for _ in range(n * layers)]).astype(np.uint8)
            trs.append(
                Trajectory(
                    response_ids=rng.integers(4, 60, n, dtype=np.int32),
                    behavior_logprobs=-(rng.random(n, dtype=np.float32) + 4.0),
                    reward=float(j),
                    finish_reason="length",
                    routed_experts=rows.reshape(n, layers, top_k) if routed else None,
                )
            )
        out.append(
            TrajectoryGroup(
                group_id=uuid.uuid4().hex,
                prompt_id=f"p{i}",
                prompt_ids=rng.integers(4, 60, 3 + i, dtype=np.int32),
                policy_version=0,
                actor_id="test",
                created_at=time.time(),
                sampling=SamplingParams(temperature=1.0, max_tokens=6),
                trajectories=trs,
                num_experts=experts if routed else None,
            )
        )
    return out


def _config(mode: str, bypass: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        moe=MoeConfig(routing_replay=mode), rollout_correction=SimpleNamespace(bypass_mode=bypass),
        logprob_chunk_tokens=4096, packing=False, no_grad_micro_batch_tokens=None, micro_batch_size=2,
    )  # fmt: skip


@pytest.mark.parametrize("packed", [False, True])
def test_recorded_routes_replayed_through_the_batch_are_exact(model, packed):
    """pi_old's recorded choices (response layout) replayed in either layout give the same log-probs and
    agreement 1: the rows sit at the positions that predict each response token."""
    policy = LogProbs(model, router=moe.RouterLogits(model))
    try:
        batch = collate(_groups(), pad_token_id=0)
        batch.routed_experts = None
        policy.recording = True
        with torch.no_grad():
            free, _ = policy(batch, 4096, packed)  # (B, R)
        policy.recording = False
        routes = policy.routes  # (B, R, L, K)
        P, R = batch.prompt_width, batch.response_ids.shape[1]
        real = batch.attention_mask[:, P - 1 : P - 1 + R].bool()
        routes = routes.masked_fill(~real[..., None, None], -1)
        batch.replay_experts = routes
        replayed, _ = policy(batch, 4096, packed)
        assert torch.allclose(free, replayed, atol=1e-6, rtol=0)
        agree = policy.router_agreement
        assert agree[0] == agree[1] == int(real.sum()) * 2
        assert torch.equal(policy.router_agreement_tokens, real.float())  # every layer, at each real row
        batch.replay_experts = (routes + 1) % 4 * (routes >= 0) - (routes < 0).long()  # other experts
        other, _ = policy(batch, 4096, packed)
        assert not torch.allclose(free, other, atol=1e-4)
        assert policy.router_agreement[0] == 0
        assert not policy.router_agreement_tokens.any()
    finally:
        policy.router.remove()


def _grad(model, mode: str) -> torch.Tensor:
    policy = LogProbs(model, router=moe.RouterLogits(model))
    try:
        batch = collate(_groups(seed=1), pad_token_id=0)
        routing.choose(_config(mode), batch)
        model.zero_grad()
        log_prob, _ = policy(batch, 4096, False)
        (log_prob * batch.response_mask).sum().backward()
        return model.model.layers[0].mlp.gate.weight.grad.clone()
    finally:
        policy.router.set_routes(None, False)
        policy.router.remove()


def test_routing_replay_setting_changes_the_gradients(model):
    off, rollout = _grad(model, "off"), _grad(model, "rollout")
    assert not torch.allclose(off, rollout)
    assert torch.equal(off, _grad(model, "off"))  # deterministic: the difference is the setting's


def test_old_pass_records_what_the_update_replays(model):
    policy = LogProbs(model, router=moe.RouterLogits(model))
    try:
        batch = collate(_groups(seed=2), pad_token_id=0)
        cfg = _config("old")
        routing.choose(cfg, batch)
        assert batch.replay_experts is None  # R2: pi_old routes freely
        old, routes = routing.old_pass(
            policy, batch, cfg, Precision.resolve("fp32", torch.device("cpu")), SINGLE
        )
        assert routes.shape == (*batch.response_ids.shape, 2, 2) and routes.dtype == torch.int16
        batch.replay_experts = routes
        replayed, _ = policy(batch, 4096, False)
        assert torch.allclose(old, replayed.detach(), atol=1e-6, rtol=0)
        assert policy.router_agreement[0] == policy.router_agreement[1] > 0
        assert batch.routed_experts is not None and not torch.equal(routes, batch.routed_experts)
    finally:
        policy.router.set_routes(None, False)
        policy.router.remove()
    bypass = collate(_groups(seed=2), pad_token_id=0)
    routing.choose(_config("old", bypass=True), bypass)
    assert bypass.replay_experts is bypass.routed_experts  # bypass: pi_old is the behaviour policy


def test_routing_replay_is_frozen_while_running(tmp_path):
    from offpolicy.learner.config import LearnerConfig, frozen_field_changes

    old = LearnerConfig(model_path=str(tmp_path), redis_url="redis://x")
    new = old.model_copy(update={"moe": MoeConfig(routing_replay="rollout")})
    assert frozen_field_changes(old, new) == ["moe.routing_replay"]
