"""The learner on CUDA (skipped without a GPU; `make test-gpu` runs these): every tensor of the loop on
the device, bf16_mixed by default, decoupled and bypass with every advantage estimator, publishing in the
checkpoint's dtype from pinned snapshots, checkpoint and resume; chunked log-probs save memory; the KL
loss with a reference streamed from host memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.batch import collate
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.policy import token_logprobs
from offpolicy.learner.persist.file_generation import snapshot_to_host
from offpolicy.learner.trainer import Learner
from offpolicy.weights.record import PolicyStore
from tests.integration.learner.test_loop import config, covering_groups

pytestmark = [pytest.mark.gpu, pytest.mark.redis]


@pytest.fixture(scope="module")
def bf16_tiny(tmp_path_factory) -> Path:
    """The tiny Llama saved in bf16, as real releases are: published weights must come back in bf16."""
    folder = make_tiny_model(
        tmp_path_factory.mktemp("bf16") / "m", hidden_size=128, num_heads=2, num_layers=2
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("preset", "estimator"),
    [
        ("decoupled_token_is", "grpo"),
        ("decoupled_geo_rs_token_tis", "rloo"),
        ("bypass_ppo_clip", "reinforce"),
        ("bypass_pg_is", "grpo"),
        ("decoupled_token_is", "gae"),
    ],
)
def test_the_loop_trains_publishes_checkpoints_and_resumes_on_cuda(
    preset, estimator, bf16_tiny, redis_url, tmp_path
):
    cfg = config(
        bf16_tiny, redis_url, tmp_path, device="cuda", rollout_correction=preset, adv_estimator=estimator,
        groups_per_step=2, micro_batch_size=4,
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2},
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(covering_groups(10, seed=0))
    learner = Learner(cfg)
    try:
        assert learner.precision.name == "bf16_mixed"
        assert {p.device.type for p in learner.model.parameters()} == {"cuda"}
        assert {p.dtype for p in learner.model.parameters()} == {torch.float32}  # fp32 masters
        for _ in range(3):
            metrics = learner.step()
            assert torch.isfinite(torch.tensor(metrics["loss"]))
        assert learner.intake.prefetched == 2  # `prefetch` is on with CUDA: steps 2 and 3 leased ahead
        learner.writer.flush()
        record = PolicyStore(redis_url, cfg.run_id).read()
        assert record.version == 3
        assert json.loads((Path(record.weights_uri) / "config.json").read_text())["dtype"] == "bfloat16"
    finally:
        learner.close()
    resumed = Learner(cfg)
    try:
        assert resumed.version == 2  # the checkpoint at step 2; v3's weights are superseded
        resumed.step()
        assert resumed.version == 3
    finally:
        resumed.close()


def test_pinned_snapshot_is_the_cast_of_the_device_tensors():
    src = {"a": torch.randn(256, 128, device="cuda"), "b": torch.arange(10, device="cuda")}
    snap = snapshot_to_host(src, torch.bfloat16)
    assert snap["a"].is_pinned() and snap["a"].dtype == torch.bfloat16 and snap["b"].dtype == torch.int64
    torch.testing.assert_close(snap["a"], src["a"].to(torch.bfloat16).cpu(), rtol=0, atol=0)
    again = snapshot_to_host(src, torch.bfloat16, into=snap)
    assert again["a"].data_ptr() == snap["a"].data_ptr()  # buffers reused


def test_chunked_logprobs_match_and_use_less_memory_with_a_large_vocabulary(tmp_path):
    """hidden 256, vocab 152k (Qwen's), 8 rows x 512 response tokens: the whole micro-batch's fp32 logits
    are 2.5 GB; chunks of 512 tokens hold 0.3 GB at a time, in the forward and the backward pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=152_064, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = LlamaForCausalLM(cfg).cuda()
    groups = covering_groups(4, seed=1, n=2, tokens=512)
    batch = collate(groups, 0).to("cuda")

    def run(chunk: int) -> tuple[torch.Tensor, float]:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp = token_logprobs(model, batch, chunk_tokens=chunk)
        lp.sum().backward()
        torch.cuda.synchronize()
        return lp.detach(), (torch.cuda.max_memory_allocated() - base) / 2**30

    whole, whole_peak = run(10**9)
    chunked, chunked_peak = run(512)
    torch.testing.assert_close(chunked, whole, atol=2e-2, rtol=0)
    assert chunked_peak < 0.5 * whole_peak, (chunked_peak, whole_peak)


@pytest.mark.parametrize("attn", ["sdpa_varlen", "flash_attention_2"])
def test_packed_logprobs_match_the_padded_ones_on_cuda(tmp_path, attn):
    """bf16 autocast on the GPU: the packed row (SDPA per sequence, or FlashAttention's varlen kernel where
    installed) gives the padded rows' log-probs within bf16 noise, and uses less memory than the padding."""
    import importlib.util

    from offpolicy.learner.model import load_model
    from tests.unit.learner.rl.test_microbatches import ragged_groups

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn is not installed")
    folder = make_tiny_model(tmp_path / "m", hidden_size=256, num_heads=4, num_layers=2)
    model = load_model(folder, "cuda", torch.float32, attn_implementation=attn)
    padded_model = load_model(folder, "cuda", torch.float32, attn_implementation="sdpa")
    batch = collate(ragged_groups(8, 4, seed=9, prompt=(10, 100), response=(1, 600)), 0).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        packed = token_logprobs(model, batch, 4096, packed=True)
        padded = token_logprobs(padded_model, batch, 4096, packed=False)
    torch.testing.assert_close(packed, padded, atol=5e-2, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_host_copy_of_weights_on_the_second_gpu_waits_on_that_gpu():
    """A one-process learner on cuda:1: the copy's event and side stream belong to cuda:1."""
    src = {"a": torch.randn(1024, 1024, device="cuda:1")}
    with torch.cuda.device(0):  # the current device is another one
        snap = snapshot_to_host(src, torch.bfloat16)
    torch.testing.assert_close(snap["a"], src["a"].to(torch.bfloat16).cpu(), rtol=0, atol=0)


def test_the_kl_loss_on_cuda_with_a_streamed_reference(bf16_tiny, redis_url, tmp_path):
    """`reference.cpu_offload` on one CUDA process: the reference's decoder layers live in pinned host
    memory and visit the GPU for their forward alone; its log-probs equal a resident reference's, and the
    first update starts at the reference (KL 0 up to bf16 rounding)."""
    from offpolicy.learner.build import build_reference
    from offpolicy.learner.config import ReferenceConfig
    from offpolicy.learner.model.precision import Precision

    groups = covering_groups(4, seed=3)
    cfg = config(
        bf16_tiny, redis_url, tmp_path, device="cuda", groups_per_step=4, kl_loss_coef=0.1,
        reference={"cpu_offload": True}, checkpoint={"checkpoint_dir": None},
    )  # fmt: skip
    device = torch.device("cuda")
    precision = Precision.resolve(None, device)
    resident = build_reference(
        cfg.model_copy(update={"reference": ReferenceConfig()}), device, precision, False
    )
    offloaded = build_reference(cfg, device, precision, False)
    layer_params = list(offloaded.lm.model.layers.parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in layer_params)
    batch = collate(groups, pad_token_id=0).to(device)
    with torch.no_grad(), precision.autocast():
        want, _ = resident(batch, 4096, True)
        got, _ = offloaded(batch, 4096, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(p.device.type == "cpu" for p in layer_params)  # back in host memory after the forward
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg)
    try:
        metrics = learner.step()
    finally:
        learner.close()
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-3)
