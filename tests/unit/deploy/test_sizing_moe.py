"""deploy/sizing.py's mixture-of-experts rows: Qwen3-30B-A3B and DeepSeek-V3 read from their committed
config.json files, planned with every expert's state and their routed activations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deploy.checks import ROOT
from deploy.sizing import MOE_ROWS, size
from offpolicy.learner.config import load_config

CONFIG = load_config(ROOT / "configs" / "learner.yaml", {})
ROW = {w.name: w for w in MOE_ROWS}


def test_qwen3_30b_a3b_trains_on_one_node_of_eight():
    w = ROW["Qwen3-30B-A3B"]
    assert w.shape.moe is not None and w.shape.active_params < w.shape.params / 8
    row = size(w, CONFIG)
    assert row.learner_gpus == 8 and row.plan_gib <= 0.9 * 80
    assert row.checkpoints_gib >= 3 * 12 * w.shape.params / 2**30  # every expert checkpointed


def test_deepseek_v3_needs_many_nodes_and_expert_parallelism():
    w = ROW["DeepSeek-V3"]
    row = size(w, CONFIG)
    assert row.learner_gpus > 64 and row.learner_gpus % w.ep == 0 and row.actor_gpus >= 32
    # without ep a gathered layer holds all 256 experts of two layers (45 GiB in bf16): no count fits
    with pytest.raises(ValueError, match="DeepSeek-V3: no rank count up to 512 fits"):
        size(replace(w, ep=1), CONFIG)
