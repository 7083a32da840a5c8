"""benchmarks/learner_profile.py: CUDA kernel names (as the profiler prints them on an H100/H200, torch
2.11) sorted into the kinds the `--profile` summary reports, and the summary's sums and busy share; a
CPU step's operators sorted the same way under the real profiler."""

from __future__ import annotations

import pytest
import torch

from learner_profile import kind, profile_step, summarize

KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "matmul",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>": "attention",
    "void fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "attention",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "elementwise",
    "triton_poi_fused_mul_silu_1": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "elementwise",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "elementwise",
    "Memcpy DtoD (Device -> Device)": "copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1>": "copy",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernels_are_sorted_by_kind(name):
    assert kind(name) == KERNELS[name]


def test_cpu_operators_views_apart_and_no_substring_accidents():
    assert kind("aten::t") == "other" and kind("aten::empty") == "other"
    assert kind("aten::tanh") == "elementwise"  # not a view, though it starts like aten::t
    assert kind("aten::addmm") == "matmul" and kind("aten::_to_copy") == "copy"
    assert kind("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"


def test_summary_sums_kinds_and_the_busy_share():
    events = [("nvjet_tst_a", 3.0, 10), ("flash_fwd_kernel", 1.0, 4), ("triton_poi_fused_mul_0", 0.5, 2),
              ("Memcpy DtoD (Device -> Device)", 0.5, 1)]  # fmt: skip
    out = summarize(events, wall_s=8.0, device=True, top=2)
    assert out["total_s"] == 5.0 and out["device_busy_share"] == 5.0 / 8.0
    assert out["kinds"]["matmul"] == {"s": 3.0, "share": 0.6}
    assert out["kinds"]["attention"]["share"] == 0.2 and out["kinds"]["collective"]["s"] == 0.0
    assert sum(k["s"] for k in out["kinds"].values()) == out["total_s"]
    assert [t["name"] for t in out["top"]] == ["nvjet_tst_a", "flash_fwd_kernel"]
    assert summarize(events, wall_s=8.0, device=False)["device_busy_share"] is None


def test_a_cpu_step_under_the_profiler():
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        x = torch.randn(32, 64)
        torch.tanh(x @ w).sum().backward()

    out = profile_step(step, torch.device("cpu"))
    assert out["measured"] == "cpu_operators" and out["step_s"] > 0
    assert out["kinds"]["matmul"]["s"] > 0 and out["kinds"]["elementwise"]["s"] > 0
    assert abs(sum(k["s"] for k in out["kinds"].values()) - out["total_s"]) < 1e-9
    names = {t["name"] for t in out["top"]}
    assert "aten::mm" in names
