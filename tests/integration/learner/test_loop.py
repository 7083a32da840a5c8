"""The learner loop on a tiny model and the embedded Redis: every preset family, the seed configs, parity,
learning, published weights loadable by transformers."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from offpolicy.buffer.errors import BufferNotReady
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig, load_config
from offpolicy.learner.model import load_model, make_tiny_model, sample_completions
from offpolicy.learner.model.policy import token_logprobs
from offpolicy.learner.rl.losses import ClipConfig, compute_policy_loss
from offpolicy.learner.trainer import Learner
from offpolicy.weights.record import PolicyStore

pytestmark = pytest.mark.redis
CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TARGET = 40  # token id whose share in a completion is the reward
PROMPT = [1, 20, 21, 22]


TINY = {"hidden_size": 64, "num_heads": 1, "num_layers": 1, "intermediate_size": 128}  # head_dim 64
TOKENS = 6  # response tokens per completion
VOCAB = 101  # the tiny model's character vocabulary


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The smallest tiny Llama (one layer, one head of 64): the loop's logic, not the model, is tested."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", **TINY)


@pytest.fixture(scope="module")
def behaviour(tiny_dir):
    """The initial policy, in eval mode: what the test producer samples from (version 0)."""
    return load_model(tiny_dir, "cpu").eval()


@pytest.fixture(scope="module")
def groups_v0(behaviour) -> list[TrajectoryGroup]:
    """Four groups sampled once from the initial policy at temperature 0.9, shared by the tests that only
    need valid version-0 data (each inserts them into its own run's buffer)."""
    return make_groups(behaviour, 4, version=0, temperature=0.9)


def make_groups(
    model, k: int, version: int, n: int = 4, tokens: int = TOKENS, temperature: float = 1.0, seed=0
):
    """`k` groups sampled from `model` with torch; reward = share of TARGET in the completion."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(k):
        comps = sample_completions(model, PROMPT, n, tokens, temperature=temperature, generator=gen)
        groups.append(
            TrajectoryGroup(
                group_id=uuid.uuid4().hex,
                prompt_id="p0",
                prompt_ids=np.asarray(PROMPT, dtype=np.int32),
                policy_version=version,
                actor_id="test",
                created_at=time.time(),
                sampling=SamplingParams(temperature=temperature, max_tokens=tokens),
                trajectories=[
                    Trajectory(
                        response_ids=np.asarray(ids, dtype=np.int32),
                        behavior_logprobs=np.asarray(lps, dtype=np.float32),
                        reward=float(np.mean(np.asarray(ids) == TARGET)),
                        finish_reason="length",
                    )
                    for ids, lps in comps
                ],
            )
        )
    return groups


def covering_groups(k: int, seed: int, n: int = 2, tokens: int = 8) -> list[TrajectoryGroup]:
    """Groups whose prompts hold every token id, so every embedding row gets a gradient."""
    rng = np.random.default_rng(seed)
    return [
        TrajectoryGroup(
            group_id=uuid.uuid4().hex,
            prompt_id=f"p{i}",
            prompt_ids=rng.permutation(VOCAB).astype(np.int32),
            policy_version=0,
            actor_id="test",
            created_at=time.time(),
            sampling=SamplingParams(temperature=1.0, max_tokens=tokens),
            trajectories=[
                Trajectory(
                    response_ids=rng.integers(4, VOCAB, tokens, dtype=np.int32),
                    behavior_logprobs=-(rng.random(tokens, dtype=np.float32) + 4.0),
                    reward=float(j % 2),
                    finish_reason="length",
                )
                for j in range(n)
            ],
        )
        for i in range(k)
    ]


def config(tiny_dir, redis_url, tmp_path, **kw) -> LearnerConfig:
    base = dict(
        model_path=str(tiny_dir),
        device="cpu",
        redis_url=redis_url,
        run_id=f"learner-{uuid.uuid4().hex[:10]}",
        groups_per_step=2,
        micro_batch_size=3,
        optimizer={"lr": 1e-3},
        publish={"weights_dir": str(tmp_path / "weights"), "keep_versions": 2},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2},
        sample_timeout_s=5.0,
    )
    return LearnerConfig.model_validate({**base, **kw})


@pytest.mark.parametrize(
    "preset",
    [
        "decoupled_token_is",
        "decoupled_token_icepop",
        "decoupled_seq_is_rs",
        "bypass_ppo_clip",
        "bypass_pg_is",
        "disabled",
    ],
)
def test_every_preset_family_trains_and_publishes(preset, tiny_dir, groups_v0, redis_url, tmp_path):
    cfg = config(
        tiny_dir, redis_url, tmp_path, rollout_correction=preset, metrics_jsonl=str(tmp_path / "m.jsonl")
    )
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups_v0)
    learner = Learner(cfg)
    try:
        steps = [learner.step() for _ in range(2)]
    finally:
        learner.close()
    for m in steps:
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
        assert "rollout_corr/kl" in m and "actor/ppo_kl" in m
    assert learner.version == 2
    record = PolicyStore(redis_url, cfg.run_id).read()
    assert record is not None and record.version == 2
    loaded = AutoModelForCausalLM.from_pretrained(record.weights_uri)
    for (name, p), q in zip(learner.model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p.detach(), q), name
    # keep_versions=2: the newest two folders stay. v1 may never have been written (a publish still waiting
    # when the next one came is replaced by it, as the actors want the newest weights): then v0 and v2
    names = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert names[-1] == "v2" and len(names) == 2 and set(names) <= {"v0", "v1", "v2"}, names
    assert (tmp_path / "ckpt" / "ckpt-0000000002" / "meta.json").exists()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["step"], r["version"], r["config_version"]) for r in lines] == [
        (1.0, 1.0, 0.0),
        (2.0, 2.0, 0.0),
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("seed_*.yaml")))
def test_seed_readme_configurations_run(name, tiny_dir, groups_v0, redis_url, tmp_path):
    file_cfg = load_config(CONFIGS / name)
    cfg = config(tiny_dir, redis_url, tmp_path, **file_cfg.model_dump(include={
        "adv_estimator", "ppo_epochs", "gamma", "lam", "rollout_correction"}))  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups_v0[:2])
    learner = Learner(cfg)
    try:
        m = learner.step()
    finally:
        learner.close()
    assert np.isfinite(m["loss"])
    assert learner.version == cfg.ppo_epochs  # one optimizer step per epoch (whole batch per mini-batch)
    if cfg.adv_estimator == "gae":
        assert np.isfinite(m["critic/vf_loss"])


def test_parity_when_all_three_policies_agree(tiny_dir, behaviour, redis_url, tmp_path):
    """pi_theta = pi_old = pi_rollout: weights all 1, nothing rejected, loss = on-policy PPO loss."""
    cfg = config(tiny_dir, redis_url, tmp_path, rollout_correction="decoupled_seq_is_rs", micro_batch_size=16)
    groups = make_groups(behaviour, 2, version=0, temperature=0.7, seed=3)
    batch = collate(groups, pad_token_id=0)
    with torch.no_grad():
        lp = token_logprobs(behaviour, batch)
        batch.behavior_logprobs = lp  # exactly pi_theta's
    trajectories = [t for g in groups for t in g.trajectories]  # collate's row order
    for row, t in enumerate(trajectories):
        t.behavior_logprobs = lp[row, : len(t.response_ids)].numpy().astype(np.float32)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg)
    try:
        m = learner.step()
    finally:
        learner.close()
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    # the on-policy PPO loss of the same batch: ratio 1, no weights
    rewards = batch.rewards.view(2, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    adv = adv[:, None] * batch.response_mask
    clip = ClipConfig(clip_ratio_low=0.2, clip_ratio_high=0.2)
    want = compute_policy_loss(lp, lp, adv, batch.response_mask, clip=clip).loss
    assert m["loss"] == pytest.approx(float(want), abs=1e-5)


@pytest.mark.slow
def test_reward_rises_on_the_learners_own_policy(tiny_dir, redis_url, tmp_path):
    """Reward = share of TARGET; groups sampled with torch from the learner's newest published weights."""
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=4, micro_batch_size=16, optimizer={"lr": 5e-3},
        rollout_correction="decoupled_token_is", checkpoint={"checkpoint_dir": None},
    )  # fmt: skip
    learner = Learner(cfg)
    store = PolicyStore(redis_url, cfg.run_id)
    rewards = []
    try:
        with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
            for step in range(10):
                learner.writer.flush()  # the newest version is published (the writer runs in the background)
                record = store.read()
                policy = AutoModelForCausalLM.from_pretrained(record.weights_uri).eval()
                buf.insert_many(make_groups(policy, 4, version=record.version, n=8, tokens=6, seed=step))
                rewards.append(learner.step()["reward_mean"])
    finally:
        learner.close()
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.1, rewards


def test_buffer_change_reconfigures_the_same_buffer_at_the_boundary(tiny_dir, groups_v0, redis_url, tmp_path):
    """A new `buffer` section reaches `ReplayBuffer.reconfigure` at the next step boundary: the same buffer
    object, its metrics still on the injected registry; the new staleness gate drops the version-0 groups
    once the learner is at version 1. The boundary is reported with the step count before it."""
    registry = CollectorRegistry()
    applied: list[tuple[int, int]] = []
    cfg = config(tiny_dir, redis_url, tmp_path, checkpoint={"checkpoint_dir": None}, sample_timeout_s=0.3)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups_v0)
    learner = Learner(cfg, registry, on_config_applied=lambda v, s: applied.append((v, s)))
    try:
        assert registry.get_sample_value("offpolicy_learner_max_staleness_steps") == float("inf")
        learner.step()  # version 0 -> 1, two of the four groups consumed
        buffer = learner.buffer
        new = cfg.model_copy(update={"buffer": cfg.buffer.model_copy(update={"max_staleness": 0})})
        learner.apply_config(new, config_version=7)
        assert applied == [] and learner.status()["config_version"] == 0  # only at the boundary
        with pytest.raises(BufferNotReady):
            learner.step()  # the two left are one version behind: dropped as stale
        assert learner.buffer is buffer and buffer.config.max_staleness == 0
        assert applied == [(7, 1)]
        status = learner.status()
        assert (status["config_version"], status["config_applied_at_step"], status["step"]) == (7, 1, 1)
        assert status["versions_per_step"] == cfg.optimizer_steps_per_step == 1  # one mini-batch a step
        assert registry.get_sample_value("offpolicy_learner_config_version") == 7.0
        assert registry.get_sample_value("offpolicy_learner_max_staleness_steps") == 0.0
        assert registry.get_sample_value("offpolicy_buffer_leased_total") == 2.0
        assert registry.get_sample_value("offpolicy_buffer_acked_total") == 2.0  # delivery: step
        assert registry.get_sample_value("offpolicy_buffer_drops_total", {"reason": "stale"}) == 2.0
    finally:
        learner.close()
