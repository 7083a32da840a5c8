"""Publishing on N ranks: every rank's shards, cast to the publish dtype, gathered to rank 0's host memory
(torchrun, 2 ranks, FSDP2 over gloo; the tiny model's 101-token vocabulary shards unevenly)."""

from __future__ import annotations

import json

import pytest

from offpolicy.learner.model import make_tiny_model
from tests.integration.torchrun import run_script

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rank0_gets_the_full_weights_in_the_publish_dtype(tmp_path, dtype):
    model = make_tiny_model(
        tmp_path / "model", hidden_size=64, num_heads=1, num_layers=2, intermediate_size=96
    )
    out = tmp_path / "result.json"
    run_script("gather_ranks.py", str(model), dtype, str(out))
    result = json.loads(out.read_text())
    assert result["names_match"] and result["shapes_match"] and result["buffers_reused"]
    assert result["dtypes"] == [f"torch.{dtype}"]
    assert result["max_abs_diff"] == 0.0  # cast per shard, then gathered: the same values as cast whole
    # publish.gather_bucket_mb bounds what rank 0 receives at once: 8 KiB buckets (a larger tensor alone)
    assert result["small_buckets_diff"] == 0.0 and result["small_buckets"] > 3 * result["one_bucket"]
    # each rank's part is padded to the largest part (uneven shards: at most one row more per rank)
    bound = max(8192, result["largest_tensor_bytes"]) + 2 * result["largest_row_bytes"]
    assert result["small_max_bucket_bytes"] <= bound
    # publish.transport vllm on 2 ranks: both join each publish's gather, rank 0 sends the full weights
    assert result["sent_versions"] == [1, 2] and result["sent_names_match"]
    assert result["sent_max_abs_diff"] == 0.0
