"""Per-layer activation checkpointing (model/recompute.py): which layers are chosen, that exactly those stop
keeping their activations (bytes autograd saves, against the plan's formula), that the gradients are those
of no checkpointing, and that the learner's build applies what `gradient_checkpointing`,
`checkpoint_layers` and the memory plan's `auto` choose (reported in its settings)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

from offpolicy.learner.batch import collate
from offpolicy.learner.build import build_models
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.fsdp import decoder_layers
from offpolicy.learner.distributed.ranks import SINGLE
from offpolicy.learner.model import (
    attention,  # noqa: F401  (registers sdpa_varlen)
    make_tiny_model,
)
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.recompute import checkpoint_layers, evenly
from offpolicy.learner.plan.auto import choose
from offpolicy.learner.plan.memory import GIB, ModelShape, token_bytes
from tests.unit.learner.rl.test_microbatches import ragged_groups

LAYERS = 4


def qwen3(seed: int = 0) -> AutoModelForCausalLM:
    hf = Qwen3Config(vocab_size=101, hidden_size=128, intermediate_size=512, num_hidden_layers=LAYERS,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32)  # fmt: skip
    hf._attn_implementation = "sdpa_varlen"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf).train()


@pytest.fixture(scope="module")
def batch():
    return collate(ragged_groups(2, 2, seed=1, prompt=(50, 100), response=(100, 200)), 0)


def test_the_layers_are_spread_evenly():
    assert evenly(0, 8) == [] and evenly(8, 8) == list(range(8))
    assert evenly(2, 4) == [1, 3] and evenly(4, 8) == [1, 3, 5, 7]
    assert evenly(3, 36) == [11, 23, 35]
    for k in range(37):
        chosen = evenly(k, 36)
        assert len(chosen) == k == len(set(chosen)) and all(0 <= i < 36 for i in chosen)


def saved_bytes(model, batch) -> int:
    """Bytes of the tensors autograd saves outside checkpointed regions in one forward (weights and their
    casts aside)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        LogProbs(model)(batch, 4096, True)
    return sum(kept.values())


def test_exactly_the_checkpointed_layers_stop_keeping_their_activations(batch):
    """k of 4 layers checkpointed: the forward keeps k layers' saved tensors fewer, each layer's bytes per
    token within 3 % of the plan's `layer_bytes` (its input, which the plan counts, is held by the
    checkpoint, not saved); the flags are on exactly the chosen layers."""
    tokens = int(batch.attention_mask.sum())
    shape = ModelShape.of(qwen3().config)
    saved = {}
    for k in (0, 2, 4):
        model = qwen3()
        chosen = checkpoint_layers(model, decoder_layers(model, LAYERS), k)
        assert chosen == evenly(k, LAYERS)
        if 0 < k < LAYERS:
            flags = [layer.gradient_checkpointing for layer in decoder_layers(model, LAYERS)]
            assert flags == [i in chosen for i in range(LAYERS)]
        saved[k] = saved_bytes(model, batch)
    per_layer = shape.layer_bytes("fp32")
    assert (saved[0] - saved[2]) / tokens == pytest.approx(2 * per_layer, rel=0.03)
    assert (saved[0] - saved[4]) / tokens == pytest.approx(4 * per_layer, rel=0.03)
    # the plan: each checkpointed layer keeps its fp32 input (4 h) instead of its saved tensors
    plan = {k: token_bytes(shape, "fp32", k) for k in (0, 2, 4)}
    assert plan[0] - plan[2] == 2 * (per_layer - 4 * shape.hidden)
    assert plan[2] - plan[4] == plan[0] - plan[2]


def test_the_gradients_are_those_of_no_checkpointing(batch):
    grads = []
    for k in (0, 2, LAYERS):
        model = qwen3(seed=3)
        checkpoint_layers(model, decoder_layers(model, LAYERS), k)
        logp, _ = LogProbs(model)(batch, 4096, True)
        (logp * batch.response_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-6)
    assert grads[0].abs().sum() > 0


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny4"), num_layers=LAYERS, hidden_size=128,
                           intermediate_size=256, num_heads=2)  # fmt: skip


def config(path, **kw) -> LearnerConfig:
    return LearnerConfig(model_path=str(path), device="cpu", checkpoint={"checkpoint_dir": None}, **kw)


def flags(built) -> list[bool]:
    model = built.parts.model
    return [bool(getattr(layer, "gradient_checkpointing", False)) for layer in decoder_layers(model, LAYERS)]


def test_the_build_checkpoints_what_the_config_and_the_plan_choose(tiny4):
    """`true` checkpoints every layer, `true` + `checkpoint_layers: 1` one, `false` none; `auto` under a
    memory limit between "all layers fit" and "none fit" checkpoints some but not all, and its settings
    report how many. Each choice shows in the layers' flags."""
    assert flags(build_models(config(tiny4, gradient_checkpointing=True), SINGLE)) == [True] * LAYERS
    one = build_models(config(tiny4, gradient_checkpointing=True, checkpoint_layers=1), SINGLE)
    assert flags(one) == [False, False, False, True] and one.settings.checkpointed_layers == 1
    assert flags(build_models(config(tiny4, gradient_checkpointing=False), SINGLE)) == [False] * LAYERS
    # a limit where 16,384 tokens fit with every layer checkpointed but not with none
    shape = ModelShape.of(AutoConfig.from_pretrained(tiny4))
    base = choose(config(tiny4, gradient_checkpointing=True), shape, 1, False, False, None).plan.total
    none = choose(config(tiny4, gradient_checkpointing=False), shape, 1, False, False, None).plan.total
    assert none > base
    limit_gib = (base + none) / 2 / GIB
    auto = build_models(config(tiny4, gradient_checkpointing="auto", memory_limit_gib=limit_gib), SINGLE)
    k = auto.settings.checkpointed_layers
    assert 0 < k < LAYERS and sum(flags(auto)) == k
    assert auto.settings.as_dict()["checkpointed_layers"] == k and auto.memory_plan.total <= limit_gib * GIB
