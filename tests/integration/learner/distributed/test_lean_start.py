"""The lean start on 2 ranks (torchrun, FSDP2 over gloo): a model built on the meta device, sharded, then
filled either by each rank reading its own rows of the safetensors files or by rank 0's broadcast, holds
exactly the weights of the model loaded whole; a checkpoint whose tensors do not map one to one onto the
model is refused by the slice reader on every rank (the learner then takes rank 0's broadcast)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from offpolicy.learner.model import make_tiny_model
from tests.integration.learner.distributed.torchrun import run_script

pytestmark = pytest.mark.slow


def test_slices_and_broadcast_give_every_rank_the_weights_it_would_have_loaded(tmp_path):
    # 101-token vocabulary over 2 ranks: uneven shards (51 + 50 rows)
    model = make_tiny_model(
        tmp_path / "model", hidden_size=64, num_heads=1, num_layers=2, intermediate_size=96
    )
    renamed = tmp_path / "renamed"
    shutil.copytree(model, renamed)
    (f,) = renamed.glob("*.safetensors")
    tensors = load_file(str(f))
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(f), metadata={"format": "pt"})
    out = tmp_path / "result"
    run_script("lean_ranks.py", str(model), str(renamed), str(out))
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got["took_slices"] and got["slices_diff"] == 0.0
        assert got["broadcast_diff"] == 0.0
        assert got["refused_renamed"]
