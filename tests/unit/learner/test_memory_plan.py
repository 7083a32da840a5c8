"""The learner's memory plan: the estimate's parts for real model shapes, and the refusal that names the
knobs, before any weight is loaded."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.errors import MemoryPlanError
from offpolicy.learner.memory_plan import GIB, ModelShape, check, estimate

QWEN_7B = LlamaConfig(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def shape_7b() -> ModelShape:
    return ModelShape.of(QWEN_7B)


def cfg(**kw) -> LearnerConfig:
    return LearnerConfig(model_path="unused", **kw)


def test_the_shape_counts_parameters_without_loading_them(shape_7b):
    assert 7.0e9 < shape_7b.params < 7.8e9  # Qwen2.5-7B has 7.6e9 (its q/k/v biases aside)


def test_one_gpu_bf16_mixed_needs_about_16_bytes_per_parameter_before_activations(shape_7b):
    plan = estimate(cfg(), shape_7b, ranks=1, sharded=False, checkpointing=True, cuda=True)
    states = plan.weights + plan.gradients + plan.optimizer + plan.compute_copies
    assert states == 18 * shape_7b.params  # 4 masters + 4 grads + 8 AdamW + 2 bf16 copies
    assert plan.total > 80 * GIB  # does not fit one H100
    with pytest.raises(
        MemoryPlanError, match=r"micro_batch_tokens.*nproc-per-node.*cpu_offload.*gradient_check"
    ):
        check(plan, int(0.9 * 80 * GIB), cfg(), 1, True)


def test_eight_gpus_shard_the_states_and_checkpointing_shrinks_activations(shape_7b):
    one = estimate(cfg(), shape_7b, ranks=8, sharded=True, checkpointing=False, cuda=True)
    ckpt = estimate(cfg(), shape_7b, ranks=8, sharded=True, checkpointing=True, cuda=True)
    assert one.optimizer == 8 * shape_7b.params // 8  # two fp32 moments, an eighth each
    assert ckpt.activations < one.activations / 10
    check(ckpt, int(0.9 * 80 * GIB), cfg(), 8, True)  # fits: no error
    offloaded = estimate(cfg(fsdp={"cpu_offload": True}), shape_7b, 8, True, True, True)
    assert offloaded.weights == offloaded.optimizer == 0 and offloaded.host_offloaded > 0


def test_the_token_budget_scales_the_activations(shape_7b):
    small = estimate(cfg(micro_batch_tokens=4096), shape_7b, 8, True, False, True)
    large = estimate(cfg(micro_batch_tokens=16384), shape_7b, 8, True, False, True)
    assert large.activations == 4 * small.activations


def test_no_limit_no_check():
    plan = estimate(cfg(), ModelShape(10**12, 8192, 28672, 80, 128256, 8192), 1, False, False, True)
    check(plan, None, cfg(), 1, False)  # CPU without memory_limit_gib: reported, not refused
