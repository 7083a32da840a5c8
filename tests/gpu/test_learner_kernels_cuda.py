"""The learner's CUDA kernels (skipped without a GPU): `torch_varlen` attention on a packed row against SDPA
on each sequence, with grouped-query attention, sliding windows and gradients; the fused log-prob head,
compiled, against the chunked one, values, gradients and memory."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from offpolicy.learner.batch import collate
from offpolicy.learner.model import attention, token_logprobs
from offpolicy.learner.model.head import head_logprobs
from offpolicy.learner.model.policy import _chunk_stats
from tests.unit.learner.rl.test_microbatches import ragged_groups

pytestmark = pytest.mark.gpu
needs_varlen = pytest.mark.skipif(
    not attention.torch_varlen_available(), reason="needs CUDA and torch.nn.attention.varlen"
)


def test_auto_picks_torch_varlen_on_cuda():
    if not attention.torch_varlen_available():
        assert attention.resolve("auto", torch.device("cuda")) == attention.SDPA_VARLEN
        return
    assert attention.resolve("auto", torch.device("cuda")) in (attention.TORCH_VARLEN, "flash_attention_2",
                                                               "flash_attention_3")  # fmt: skip


@needs_varlen
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_varlen_kernel_equals_sdpa_on_each_sequence(window, heads, kv_heads):
    """One call on the packed row = SDPA per sequence in fp32 (the window as a banded mask), forward and
    backward, in bf16 within bf16 noise."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = (37, 1, 120, 64, 9)
    T, D = sum(lens), 64
    q, k, v = (
        torch.randn(1, h, T, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    kwargs = attention.packed_kwargs(lens, torch.device("cuda"))
    module = torch.nn.Module()
    out, _ = attention.torch_varlen_attention(module, q, k, v, None, sliding_window=window, **kwargs)
    ref, _ = attention.sdpa_varlen_attention(
        module, *(t.float() for t in (q, k, v)), None, sliding_window=window, packed_seq_lens=lens
    )
    assert out.shape == (1, T, heads, D)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    w = torch.randn(out.shape, device="cuda", generator=gen)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, want, strict=True):
        torch.testing.assert_close(g.float(), r.float(), atol=5e-2, rtol=5e-2)


@needs_varlen
def test_packed_logprobs_with_torch_varlen_match_the_per_sequence_kernel_with_a_window():
    cfg = MistralConfig(
        vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, sliding_window=16, max_position_embeddings=1024,
    )  # fmt: skip
    model = MistralForCausalLM(cfg).cuda()
    batch = collate(ragged_groups(4, 4, seed=9, prompt=(10, 60), response=(1, 200)), 0).to("cuda")
    out = {}
    for kernel in (attention.TORCH_VARLEN, attention.SDPA_VARLEN):
        model.set_attn_implementation(kernel)
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            out[kernel] = token_logprobs(model, batch, 4096, packed=True)
    torch.testing.assert_close(out[attention.TORCH_VARLEN], out[attention.SDPA_VARLEN], atol=3e-2, rtol=0)


@pytest.mark.parametrize("entropy", [False, True])
def test_the_compiled_fused_head_equals_the_chunked_one_and_holds_less(entropy):
    """Vocabulary 152k, 2,048 tokens, bf16 autocast: the same log-probs (fp32 of bf16 logits) and
    gradients; the fused head's peak memory is well under the chunked one's (about half)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    head = torch.nn.Linear(512, 151936, bias=False, device="cuda")
    torch.nn.init.normal_(head.weight, std=0.05, generator=gen)
    h = torch.randn(2048, 512, device="cuda", generator=gen)
    ids = torch.randint(0, 151936, (2048,), device="cuda", generator=gen)
    temps = torch.full((2048, 1), 0.8, device="cuda")
    runs = {}
    for fused in (True, False):
        for _ in range(2):  # the second run is measured (the first compiles)
            head.zero_grad(set_to_none=True)
            x = h.clone().requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if fused:
                    lp, ent = head_logprobs(head, x, ids, temps, None, entropy)
                else:
                    lp, ent = _chunk_stats(head, None, x, ids, temps, entropy)
            loss = lp.sum() + (ent.sum() if entropy else 0.0)
            loss.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        runs[fused] = (lp.detach(), ent, x.grad, head.weight.grad, peak)
    (lp_f, ent_f, gh_f, gw_f, peak_f), (lp_c, ent_c, gh_c, gw_c, peak_c) = runs[True], runs[False]
    torch.testing.assert_close(lp_f, lp_c, atol=1e-4, rtol=0)
    if entropy:
        # entropies ~10.8 summed over 152k bf16 logits in another order: within 2e-3 relative (H200: 7.7e-4)
        torch.testing.assert_close(ent_f.detach(), ent_c.detach(), atol=1e-3, rtol=2e-3)
    torch.testing.assert_close(gh_f, gh_c, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gw_f, gw_c, atol=1e-2, rtol=1e-2)
    assert peak_f < 0.6 * peak_c, (peak_f / 2**30, peak_c / 2**30)  # H200: 2.46 vs 4.78 GiB (0.51)


@needs_varlen
def test_compiled_layers_keep_one_graph_for_every_count_of_sequences():
    """compile_layers (inductor) with torch_varlen on 12 packed micro-batches of 10 distinct numbers of
    sequences (more than dynamo's recompile limit of 8): one graph for all (no count compiled anew, none
    left eager), and the logits of the eager layers (tests/unit/learner/model/test_compile_shapes.py runs
    the same on CPU with a stand-in kernel)."""
    from torch._dynamo.utils import counters

    from offpolicy.learner.model.compile import compile_layers
    from tests.unit.learner.model.test_compile_shapes import micro_batches, qwen3

    torch._dynamo.reset()
    counters.clear()
    runs = []
    for compiled in (False, True):
        model = qwen3(attention.TORCH_VARLEN).cuda()
        if compiled:
            compile_layers(model.model.layers)
        out = []
        for ids, pos, kwargs in micro_batches(model.config.vocab_size, torch.device("cuda")):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
            logits.float().square().mean().backward()
            out.append(logits.detach().float())
        runs.append(out)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # the first shape, then dynamic
    for eager, compiled in zip(*runs, strict=True):
        torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=2e-2)


def test_the_benchmark_profile_sorts_real_cuda_kernels():
    """benchmarks/learner_profile.py on a CUDA step: a bf16 matrix product is `matmul`, SDPA is
    `attention`, and the kernels' time is at most the step's wall time (busy share in (0, 1])."""
    from learner_profile import profile_step

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step():
        for _ in range(4):
            (a @ a).relu_()
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    step()  # the first calls pick their kernels
    out = profile_step(step, torch.device("cuda"))
    assert out["measured"] == "kernels" and 0 < out["device_busy_share"] <= 1.05, out
    kinds = out["kinds"]
    assert kinds["matmul"]["share"] > 0.3 and kinds["attention"]["s"] > 0, out
    assert abs(sum(k["s"] for k in kinds.values()) - out["total_s"]) < 1e-9
