"""On-policy distillation end to end: a tiny student learner with a teacher (the same tiny Llama trained a
few steps to prefer a handful of tokens, the same tokenizer) trains on groups sampled with torch from its
own newest published weights, with the task reward's weight 0; over 15 learner steps the per-token reverse
KL to the teacher (`distill/reverse_kl`) falls by more than half, and it reaches /metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model, load_tokenizer
from offpolicy.learner.trainer import Learner
from offpolicy.weights.record import PolicyStore
from tests.integration.learner.test_loop import PROMPT, TOKENS, config, make_groups, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis
PREFERRED = (40, 41, 42)  # the tokens the teacher learned to say
STEPS = 15


@pytest.fixture(scope="module")
def teacher_dir(tiny_dir, tmp_path_factory):  # noqa: F811
    """The student's initial model trained 60 Adam steps of cross-entropy on PROMPT + PREFERRED tokens."""
    model = load_model(tiny_dir, "cpu").train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        picks = torch.tensor(PREFERRED)[torch.randint(0, len(PREFERRED), (16, TOKENS), generator=gen)]
        ids = torch.cat([torch.tensor([PROMPT] * 16), picks], dim=1)  # (16, P + TOKENS)
        labels = ids.clone()
        labels[:, : len(PROMPT)] = -100  # the loss on the response alone
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("teacher") / "model"
    model.save_pretrained(out)
    load_tokenizer(tiny_dir).save_pretrained(out)
    return out


def test_the_reverse_kl_to_the_teacher_falls_by_half(tiny_dir, teacher_dir, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=4, micro_batch_size=16, optimizer={"lr": 1e-2},
        checkpoint={"checkpoint_dir": None},
        teacher={"model_path": str(teacher_dir), "reward_weight": 1.0, "task_reward_weight": 0.0},
    )  # fmt: skip
    registry = CollectorRegistry()
    learner = Learner(cfg, registry)
    store = PolicyStore(redis_url, cfg.run_id)
    kls, steps = [], []
    try:
        assert learner.teacher is not None and not any(p.requires_grad for p in learner.teacher.parameters())
        with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
            for step in range(STEPS):
                learner.writer.flush()  # the newest version is published (the writer runs in the background)
                record = store.read()
                student = AutoModelForCausalLM.from_pretrained(record.weights_uri).eval()
                buf.insert_many(make_groups(student, 4, version=record.version, n=8, seed=step))
                steps.append(learner.step())
                kls.append(steps[-1]["distill/reverse_kl"])
    finally:
        learner.close()
    first, last = np.mean(kls[:2]), np.mean(kls[-3:])
    print(f"distill/reverse_kl over {STEPS} steps: {[round(k, 3) for k in kls]}")
    assert first > 0.5, kls  # the untrained student is far from the teacher
    assert last <= 0.5 * first, kls  # the target: the KL falls by at least half
    gauge = registry.get_sample_value("offpolicy_learner_distill_reverse_kl")
    assert gauge == pytest.approx(kls[-1])
