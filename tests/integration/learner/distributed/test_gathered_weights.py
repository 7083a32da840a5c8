"""Publishing on N ranks: every rank's shards, cast to the publish dtype, gathered to rank 0's host memory
(torchrun, 2 ranks, FSDP2 over gloo; the tiny model's 101-token vocabulary shards unevenly)."""

from __future__ import annotations

import json

import pytest

from offpolicy.learner.model import make_tiny_model
from tests.integration.learner.distributed.torchrun import run_script

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


def test_rank0_streams_the_gather_into_the_files_and_a_slow_writer_coalesces(tmp_path):
    """The files transport on N ranks: rank 0 never holds the full weights (the gather waits on the writer
    with at most STREAM_DEPTH buckets queued, one more in hand); versions published while the writer is
    busy are coalesced on every rank alike, the newest written at flush; each written version is the
    weights of its step, exactly."""
    result = run_on_many_buckets(tmp_path, "stream_ranks.py")
    assert result["versions"] == [1, 3]  # v2 replaced by v3 before its gather began
    assert result["coalesced"] == 1
    assert result["max_abs_diff"] == {"1": 0.0, "3": 0.0}
    assert result["buckets_total"] >= 2 * (result["stream_depth"] + 1)
    assert result["buckets_held"] == result["stream_depth"] + 1  # the queue full, one in hand: blocked
    assert result["kept"] == 0  # nothing kept in rank 0's host memory


def test_a_lora_learner_gathers_and_publishes_its_adapter_alone(tmp_path):
    """`lora:` on N ranks: of the names to publish only the adapter's are gathered (its A factors shard
    unevenly: rank 3 over 2 ranks), streamed into rank 0's adapter folder under peft's names."""
    model = make_tiny_model(
        tmp_path / "model", hidden_size=64, num_heads=1, num_layers=2, intermediate_size=96
    )
    out = tmp_path / "result.json"
    run_script("lora_publish_ranks.py", str(model), str(tmp_path / "weights"), str(out))
    result = json.loads(out.read_text())
    assert result["files"] == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert result["names_match"] and result["dtypes"] == ["torch.bfloat16"]
    assert result["max_abs_diff"] == 0.0
    assert result["config"]["r"] == 3 and result["config"]["target_modules"] == [
        "q_proj",
        "up_proj",
        "v_proj",
    ]


def test_delta_versions_on_two_ranks_build_bit_equal(tmp_path):
    """`publish.delta` on N ranks: the gather streams into rank 0's writer, which writes each version whole
    (v1, then v5: `full_every` 4 counts from the last whole one) or as its changes against the last one;
    each version an actor builds from them is bit-equal to the sharded model's full weights in bf16; only
    rank 0 keeps a base."""
    model = make_tiny_model(
        tmp_path / "model", hidden_size=256, num_heads=4, num_layers=2, intermediate_size=1024
    )  # several buckets of 1 MiB
    out = tmp_path / "result.json"
    run_script("delta_ranks.py", str(model), str(tmp_path / "weights"), str(out))
    result = json.loads(out.read_text())
    assert [r["base"] for r in result["versions"]] == [None, 1, 2, 3, None, 5]
    assert all(r["bit_equal"] for r in result["versions"]), result
    assert result["delta_base_bytes"] > 0 and result["holders"] == 1
    assert 0 < result["delta_share_gauge"] < 1  # offpolicy_learner_publish_delta_share of the last version


def test_the_vllm_transport_on_2_ranks_gathers_in_the_background_and_sends_what_each_step_trained(tmp_path):
    """`publish.transport: vllm` with a broadcast backend on 2 ranks: a publish never waits for its gather
    (rank 1's part held back: v1's publish returns with it under way, nothing sent); versions published
    meanwhile wait, the newest replacing the older; rank 0 sends each gathered version at a step boundary,
    bit-equal to the weights of its step, and writes those due as files (persist_every 3: v1, v4) or asked
    for by a checkpoint (v5)."""
    result = run_on_many_buckets(tmp_path, "kept_ranks.py")
    assert result["sent_while_held"] == [] and result["under_way_after_publish"] == [True, True, True]
    assert max(result["publish_s_while_held"]) < 5.0, result["publish_s_while_held"]  # the gate: 60 s
    assert result["sent"] == [1, 4, 5] and result["coalesced"] == 2  # v2 by v3, v3 by v4
    assert result["sent_names_match"] and set(result["sent_max_abs_diff"].values()) == {0.0}
    assert result["written_max_abs_diff"] == {"1": 0.0, "4": 0.0, "5": 0.0}
    assert result["left_in_publisher"] == 0  # the host set is the next gather's


def run_on_many_buckets(tmp_path, script: str) -> dict:
    """`script` on 2 ranks publishing a model of ~6 MiB in bf16 (8 buckets of 1 MiB) into tmp_path/weights;
    the result it wrote."""
    model = make_tiny_model(
        tmp_path / "model", hidden_size=256, num_heads=4, num_layers=3, intermediate_size=1024
    )
    out = tmp_path / "result.json"
    run_script(script, str(model), str(tmp_path / "weights"), str(out))
    return json.loads(out.read_text())
