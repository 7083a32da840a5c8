"""benchmarks/learner.py --shape longtail-moe without a GPU: the shape is Qwen3-30B-A3B's layer with as many
layers as the memory plan fits in 90 % of 80 GiB (one more does not fit); its 1-layer reduced version builds
and runs forward on CPU, its MFU parameters are the active ones; the full shape is refused on CPU."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

import learner_longtail
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.plan.memory import GIB, HEADROOM, ModelShape, estimate


def test_the_shape_has_the_layers_the_plan_fits_on_80_gib():
    _, dims = learner_longtail.SHAPES["longtail-moe"]
    layers = dims["num_hidden_layers"]
    assert (dims["num_experts"], dims["num_experts_per_tok"], dims["moe_intermediate_size"]) == (128, 8, 768)
    config = LearnerConfig(model_path="unused", micro_batch_tokens=16384, compile_layers=False)

    def total(n: int) -> int:
        shape = ModelShape.of_dict(learner_longtail.QWEN3_30B_A3B | {"num_hidden_layers": n})
        return estimate(config, shape, 1, False, True, cuda=True).total

    assert total(layers) <= HEADROOM * 80 * GIB < total(layers + 1)
    assert learner_longtail.moe_layers_that_fit(141) > layers  # an H200 holds more


def test_a_one_layer_reduced_version_builds_and_counts_active_parameters_for_mfu():
    kind, dims = learner_longtail.SHAPES["longtail-moe"]
    small = dims | learner_longtail.SMOKE | learner_longtail.MOE_SMOKE | {"num_hidden_layers": 1}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(kind(**small))
    ids = torch.randint(0, small["vocab_size"], (1, 8))  # (B, T)
    assert model(ids).logits.shape == (1, 8, small["vocab_size"])  # (B, T, V)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    embedding = small["vocab_size"] * small["hidden_size"]
    # 2 of 4 experts a token goes to: half the experts left out, and the input embedding (a lookup)
    assert learner_longtail.matmul_params(model) == total - embedding - experts // 2


def test_the_full_shape_is_refused_on_cpu():
    args = argparse.Namespace(shape="longtail-moe", device="cpu", smoke=False)
    with pytest.raises(SystemExit, match="longtail-moe is a GPU shape"):
        learner_longtail.run_shape(args)
