"""The learner's memory plan: the estimate's parts for real model shapes, the refusal that names the
knobs, before any weight is loaded; the `auto` settings it chooses, and its activation bytes against what
autograd saves."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.errors import MemoryPlanError
from offpolicy.learner.plan.auto import MAX_TOKENS, MIN_TOKENS, choose
from offpolicy.learner.plan.memory import DEFAULT_TOKENS, GIB, ModelShape, check, estimate

QWEN_7B = LlamaConfig(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def shape_7b() -> ModelShape:
    return ModelShape.of(QWEN_7B)


def cfg(**kw) -> LearnerConfig:
    """Eager layers unless a test says otherwise (compiled: tests/unit/learner/test_memory_compiled.py)."""
    return LearnerConfig(model_path="unused", **({"compile_layers": False} | kw))


def test_the_shape_counts_parameters_without_loading_them(shape_7b):
    assert 7.0e9 < shape_7b.params < 7.8e9  # Qwen2.5-7B has 7.6e9 (its q/k/v biases aside)


def test_one_gpu_bf16_mixed_needs_about_16_bytes_per_parameter_before_activations(shape_7b):
    plan = estimate(cfg(), shape_7b, ranks=1, sharded=False, checkpointing=True, cuda=True)
    states = plan.weights + plan.gradients + plan.optimizer + plan.compute_copies
    assert states == 18 * shape_7b.params  # 4 masters + 4 grads + 8 AdamW + 2 bf16 copies
    assert plan.total > 80 * GIB  # does not fit one H100
    with pytest.raises(MemoryPlanError, match=r"micro_batch_tokens.*nproc-per-node.*cpu_offload") as e:
        check(plan, int(0.9 * 80 * GIB), cfg(), 1, True)
    # every layer checkpointed: that lever is not offered again, and the message says so
    assert "checkpoint more layers" not in str(e.value) and "every layer is checkpointed already" in str(
        e.value
    )
    with pytest.raises(
        MemoryPlanError, match=r"checkpoint more layers \(gradient_checkpointing: true, now 7 of 28\)"
    ):
        check(plan, int(0.9 * 80 * GIB), cfg(), 1, 7, layers=28)
    with pytest.raises(MemoryPlanError) as e:  # all 28 of 28: none to add; a LoRA run is not told to use LoRA
        check(plan, int(0.9 * 80 * GIB), cfg(lora={"rank": 8}), 1, 28, layers=28)
    assert "checkpoint more layers" not in str(e.value) and "LoRA" not in str(e.value)


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


# --- the auto settings

LLAMA_1_8B = LlamaConfig(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=8192, tie_word_embeddings=False,
)  # fmt: skip
H200, H100 = int(0.9 * 139.8 * GIB), int(0.9 * 79.6 * GIB)


@pytest.fixture(scope="module")
def shape_1_8b() -> ModelShape:
    return ModelShape.of(LLAMA_1_8B)


def test_checkpointing_is_off_where_the_micro_batch_fits_without_it(shape_1_8b):
    """1.78B on one GPU, 16,384 tokens: ~86 GiB without checkpointing fits an H200's 126, not an H100's
    72; None means `auto` on CUDA, off on CPU."""
    on_h200 = choose(cfg(), shape_1_8b, 1, False, True, H200)
    on_h100 = choose(cfg(), shape_1_8b, 1, False, True, H100)
    assert not on_h200.checkpointing and on_h200.plan.total <= H200
    assert on_h100.checkpointing and on_h100.plan.total <= H100
    assert choose(cfg(gradient_checkpointing=True), shape_1_8b, 1, False, True, H200).checkpointing
    assert not choose(cfg(), shape_1_8b, 1, False, False, None).checkpointing  # CPU


def test_an_auto_budget_is_the_largest_that_fits(shape_1_8b):
    for limit in (H200, H100):
        s = choose(cfg(micro_batch_tokens="auto"), shape_1_8b, 1, False, True, limit)
        assert s.plan.total <= limit
        more = estimate(
            cfg(), shape_1_8b, 1, False, s.checkpointed_layers, True, tokens=s.micro_batch_tokens + 1024
        )
        assert more.total > limit or s.micro_batch_tokens == MAX_TOKENS
        assert s.micro_batch_tokens >= MIN_TOKENS
    tight = choose(cfg(micro_batch_tokens="auto"), shape_1_8b, 1, False, True, H200)
    assert not tight.checkpointing and tight.micro_batch_tokens > 16384  # the H200 takes more than 16k


def test_the_no_grad_budget_keeps_no_activations_and_is_larger(shape_1_8b):
    s = choose(cfg(no_grad_micro_batch_tokens="auto"), shape_1_8b, 1, False, True, H100)
    assert s.micro_batch_tokens == 16384 and s.no_grad_micro_batch_tokens > 8 * 16384
    assert choose(cfg(), shape_1_8b, 1, False, True, H100).no_grad_micro_batch_tokens == 16384  # None


def test_the_chosen_budgets_replace_auto_in_the_steps_config(shape_1_8b):
    config = cfg(micro_batch_tokens="auto", no_grad_micro_batch_tokens="auto")
    s = choose(config, shape_1_8b, 1, False, True, H100)
    applied = s.apply(config)
    assert applied.micro_batch_tokens == s.micro_batch_tokens
    assert applied.no_grad_micro_batch_tokens == s.no_grad_micro_batch_tokens
    assert s.apply(cfg(micro_batch_tokens=4096)).no_grad_micro_batch_tokens == 4096
    assert choose(config, shape_1_8b, 1, False, False, None).micro_batch_tokens == DEFAULT_TOKENS


@pytest.mark.parametrize(
    ("model", "autocast"),
    [("llama", True), ("qwen3", True), ("llama", False), ("qwen3", False)],
    ids=["llama", "qwen3", "fp32", "qwen3-fp32"],
)
def test_the_activation_bytes_are_what_autograd_saves(model, autocast):
    """A 2-layer and a 1-layer model on the same packed micro-batch: the bytes their forwards keep for the
    backward pass differ by one layer's, which the plan's per-token formula gives within 3 %."""
    from transformers import Qwen3Config

    from offpolicy.learner.batch import collate
    from offpolicy.learner.model import attention  # noqa: F401  (registers sdpa_varlen)
    from offpolicy.learner.model.policy import LogProbs
    from tests.unit.learner.rl.test_microbatches import ragged_groups

    kind = Qwen3Config if model == "qwen3" else LlamaConfig
    batch = collate(ragged_groups(2, 2, seed=1, prompt=(50, 100), response=(100, 200)), 0)
    tokens = int(batch.attention_mask.sum())
    saved = []
    for layers in (1, 2):
        hf = kind(vocab_size=101, hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32)  # fmt: skip
        hf._attn_implementation = "sdpa_varlen"
        lm = AutoModelForCausalLM.from_config(hf)
        weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}
        shapes = {tuple(p.shape) for p in lm.parameters()}
        kept: dict[int, int] = {}

        def keep(t, weights=weights, shapes=shapes, kept=kept):
            if t.untyped_storage().data_ptr() not in weights and tuple(t.shape) not in shapes:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # not a weight's cast
            return t

        with (
            torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        ):
            LogProbs(lm)(batch, 4096, True)
        saved.append(sum(kept.values()))
    per_layer = (saved[1] - saved[0]) / tokens
    want = ModelShape.of(hf).layer_bytes("bf16_mixed" if autocast else "fp32")
    assert per_layer == pytest.approx(want, rel=0.03)


QWEN3_4B = dict(
    hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
    tie_word_embeddings=True,
)  # fmt: skip


def test_auto_checkpoints_the_fewest_layers_that_fit(shape_1_8b):
    """Where 16,384 tokens do not fit without checkpointing, `auto` checkpoints the fewest layers with
    which they do (one fewer does not fit), not all of them: the 1.78B on an H100 and the Qwen3-4B shape
    on an H200, where recomputing every layer would cost a third more of the layers' compute for nothing.
    `checkpoint_layers` fixes the count; `true` is every layer."""
    from transformers import Qwen3Config

    shape_4b = ModelShape.of(Qwen3Config(**QWEN3_4B))
    for shape, limit in ((shape_1_8b, H100), (shape_4b, H200)):
        s = choose(cfg(), shape, 1, False, True, limit)
        k = s.checkpointed_layers
        assert 0 < k < shape.layers and s.plan.total <= limit, (k, shape.layers)
        fewer = estimate(cfg(), shape, 1, False, k - 1, True, tokens=16384)
        assert fewer.total > limit
        assert s.as_dict() == {
            "gradient_checkpointing": True, "checkpointed_layers": k, "decoder_layers": shape.layers,
            "micro_batch_tokens": 16384, "no_grad_micro_batch_tokens": 16384, "compile_layers": False,
        }  # fmt: skip
    fixed = choose(cfg(checkpoint_layers=20), shape_4b, 1, False, True, H200)
    assert fixed.checkpointed_layers == 20
    assert choose(cfg(gradient_checkpointing=True), shape_4b, 1, False, True, H200).checkpointed_layers == 36
    on = choose(cfg(gradient_checkpointing=True, checkpoint_layers=99), shape_4b, 1, False, True, H200)
    assert on.checkpointed_layers == 36  # at most every layer
    # an auto budget with the fewest layers: the largest that fits with them, at least 16,384
    budget = choose(cfg(micro_batch_tokens="auto"), shape_4b, 1, False, True, H200)
    assert budget.checkpointed_layers == choose(cfg(), shape_4b, 1, False, True, H200).checkpointed_layers
    assert MIN_TOKENS <= budget.micro_batch_tokens < MIN_TOKENS + 1024 * 2


def test_a_frozen_vision_tower_has_weights_but_no_gradients_moments_or_copies(tmp_path):
    """A vision-language model's tower is counted apart (`ModelShape.vision`, the parameters under
    `model.visual.` of the model transformers builds); frozen (the default) it has its weights alone,
    `vision.train` adds its gradients, AdamW moments and autocast copies, byte for byte."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from offpolicy.learner.model import make_tiny_vl_model

    path = make_tiny_vl_model(tmp_path / "vl")
    shape = ModelShape.of(AutoConfig.from_pretrained(path))
    model = AutoModelForImageTextToText.from_pretrained(path)
    tower = sum(p.numel() for p in model.model.visual.parameters())
    assert 0 < shape.vision == tower < shape.params == sum(p.numel() for p in model.parameters())
    base = {"model_path": str(path), "precision": "bf16_mixed"}
    frozen = estimate(LearnerConfig(**base), shape, 1, False, False, cuda=True)
    trained = estimate(LearnerConfig(**base, vision={"train": True}), shape, 1, False, False, cuda=True)
    assert trained.weights == frozen.weights
    assert trained.gradients - frozen.gradients == 4 * tower  # fp32 master gradients
    assert trained.optimizer - frozen.optimizer == 8 * tower  # two fp32 moments
    assert trained.compute_copies - frozen.compute_copies == 2 * tower  # autocast's bf16 copies
