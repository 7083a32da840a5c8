"""On-policy distillation's pieces: the distillation term of the advantages by hand (signs, masking, the
two weights), the tokenizer check that refuses a teacher at start naming both models, and the teacher in
the device and host memory plans."""

from __future__ import annotations

import pytest
import torch

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.errors import TokenizerMismatch
from offpolicy.learner.model.reference import check_teacher_tokenizer
from offpolicy.learner.model.tiny import build_char_tokenizer
from offpolicy.learner.plan.host import host_plan
from offpolicy.learner.plan.memory import ModelShape, estimate
from offpolicy.learner.rl.advantages import distill
from offpolicy.learner.trainer import Learner

# two rows of three tokens; row 1's last token is padding, row 0's middle one rejected by the correction
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.2, 0.0]])
TEACHER = torch.tensor([[-0.5, -4.0, -2.5], [-1.0, -0.2, -9.0]])
MASK = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
TASK = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]])  # a GRPO advantage broadcast over each row


def test_the_distillation_term_by_hand():
    adv, kl = distill(TASK, OLD, TEACHER, MASK, reward_weight=1.0, task_reward_weight=0.0)
    # -(log pi_old - log pi_teacher) on kept tokens: positive where the teacher likes the token more
    want = torch.tensor([[0.5, 0.0, -2.0], [2.0, 0.0, 0.0]])
    assert torch.allclose(adv, want)
    # the token mean of log pi_old - log pi_teacher over the 4 kept tokens: (-0.5 + 2.0 - 2.0 + 0.0) / 4
    assert float(kl) == pytest.approx((-0.5 + 2.0 - 2.0 + 0.0) / 4)


def test_the_weights_mix_the_task_advantage_and_the_distillation_term():
    adv, _ = distill(TASK, OLD, TEACHER, MASK, reward_weight=0.5, task_reward_weight=2.0)
    gap = (OLD - TEACHER) * MASK
    assert torch.allclose(adv, 2.0 * TASK * MASK - 0.5 * gap)
    assert adv[0, 1] == 0 and adv[1, 2] == 0  # masked tokens get nothing, whatever the task's advantage
    task_only, kl = distill(TASK, OLD, TEACHER, MASK, reward_weight=0.0, task_reward_weight=1.0)
    assert torch.allclose(task_only, TASK * MASK)  # w_distill 0: the task's advantage alone
    assert float(kl) == pytest.approx(-0.125)  # still measured


def test_the_term_is_detached_so_the_gradient_flows_through_the_ratio_alone():
    old = OLD.clone().requires_grad_(True)
    adv, _ = distill(TASK, old, TEACHER, MASK, reward_weight=1.0, task_reward_weight=0.0)
    assert not adv.requires_grad


def _tokenizer_dir(path, extra: str | None = None) -> str:
    tok = build_char_tokenizer()
    if extra is not None:
        tok.add_special_tokens({"additional_special_tokens": [extra]})
    tok.save_pretrained(path)
    return str(path)


def test_a_teacher_with_another_tokenizer_is_refused_at_start_naming_both(tmp_path):
    student = _tokenizer_dir(tmp_path / "student")
    teacher = _tokenizer_dir(tmp_path / "teacher", extra="<|im_end|>")
    same = _tokenizer_dir(tmp_path / "same")
    check_teacher_tokenizer(LearnerConfig(model_path=student, teacher={"model_path": same}))  # no error
    check_teacher_tokenizer(LearnerConfig(model_path=student))  # no teacher: nothing read
    cfg = LearnerConfig(model_path=student, device="cpu", teacher={"model_path": teacher})
    with pytest.raises(TokenizerMismatch) as err:
        Learner(cfg)  # refused before any weight loads (the folders hold no model at all)
    message = str(err.value)
    assert student in message and teacher in message
    assert "vocabulary (101 vs 102 tokens" in message and "<|im_end|>" in message


QWEN_1_5B = ModelShape(1_500_000_000, 1536, 8960, 28, 151936, 32768)
QWEN_7B = ModelShape(7_600_000_000, 3584, 18944, 28, 152064, 32768)


def test_the_memory_plans_count_the_teacher_like_the_reference():
    cfg = LearnerConfig(model_path="unused", teacher={"model_path": "unused-teacher"})
    plain = estimate(LearnerConfig(model_path="unused"), QWEN_1_5B, 1, False, True, True)
    taught = estimate(cfg, QWEN_1_5B, 1, False, True, True, teacher=QWEN_7B)
    assert plain.teacher == 0 and taught.teacher == 2 * QWEN_7B.params  # bf16, on the device
    assert taught.total == plain.total + taught.teacher
    sharded = estimate(cfg, QWEN_1_5B, 8, True, True, True, teacher=QWEN_7B)
    assert sharded.teacher == 2 * QWEN_7B.params // 8
    off = LearnerConfig(model_path="unused", teacher={"model_path": "t", "cpu_offload": True})
    offloaded = estimate(off, QWEN_1_5B, 8, True, True, True, teacher=QWEN_7B)
    assert offloaded.teacher == 0 and offloaded.host_offloaded == 2 * QWEN_7B.params // 8
    assert host_plan(off, QWEN_1_5B.params, 8, True, True, QWEN_7B.params).teacher == 2 * QWEN_7B.params // 8
    assert host_plan(cfg, QWEN_1_5B.params, 8, True, True, QWEN_7B.params).teacher == 0  # on the device
