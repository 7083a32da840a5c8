"""`compile_layers` on packed micro-batches whose number of sequences changes every time (as a long-tailed
RL batch's do): the compiled decoder layers keep one graph for every count instead of one per count.

The lengths went to the kernels as a tuple, which dynamo guards by its length: each new count compiled
the layer again, and after 8 (dynamo's recompile limit) the rest of the run was eager. On CUDA the kernel
is `torch_varlen` (PyTorch's `varlen_attn`, an opaque operator); here a stand-in operator with the same
signature and the same opacity (a custom op, SDPA on each sequence inside) takes its place, so that what
dynamo sees of our attention wrapper is what it sees on the GPU. Dynamo runs with its `eager` backend:
the guards and graphs are the same as under inductor, without minutes of C++ compilation.
tests/gpu/test_learner_kernels_cuda.py runs the real kernel under inductor."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.functional import scaled_dot_product_attention
from transformers import AutoModelForCausalLM, Qwen3Config

from offpolicy.learner.model import attention
from offpolicy.learner.model.compile import compile_layers


def _each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """(T, H, D) causal attention on each sequence between the cumulative lengths `cu`."""
    parts = [
        scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                     enable_gqa=True).transpose(0, 1)
        for a, b in itertools.pairwise(cu)
    ]  # fmt: skip
    return torch.cat(parts)


@torch.library.custom_op("offpolicy_test::varlen", mutates_args=())
def _varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_q: int
) -> torch.Tensor:
    assert max_q == int((cu[1:] - cu[:-1]).max())  # an int annotation is a SymInt, as varlen_attn's max_q
    return _each(q, k, v, cu.tolist())


@_varlen_op.register_fake
def _(q, k, v, cu, max_q):
    return torch.empty_like(q)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return *torch.autograd.grad(_each(*leaves, cu.tolist()), leaves, grad), None, None


_varlen_op.register_autograd(_backward, setup_context=_setup)


def stand_in_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, is_causal=True, enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's signature (torch 2.11's keywords), causal, the default scale
    (the model's 1 / sqrt(head_dim), as SDPA's)."""
    assert is_causal and scale in (None, q.shape[-1] ** -0.5)
    return _varlen_op(q, k, v, cu_q, max_q)


COUNTS = [7, 5, 3, 2, 5, 6, 4, 9, 8, 11, 10, 12]  # sequences per micro-batch: 10 distinct counts > 8


def micro_batches(vocab: int, device: torch.device = torch.device("cpu"), seed: int = 0):
    """(input_ids (1, T), position_ids (1, T), packed_kwargs) of one packed row per count of `COUNTS`."""
    gen = torch.Generator().manual_seed(seed)
    for n in COUNTS:
        lens = torch.randint(3, 30, (n,), generator=gen).tolist()
        ids = torch.randint(0, vocab, (1, sum(lens)), generator=gen)
        pos = torch.cat([torch.arange(m) for m in lens])[None]
        yield ids.to(device), pos.to(device), attention.packed_kwargs(lens, device)


def qwen3(kernel: str) -> AutoModelForCausalLM:
    hf = Qwen3Config(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    hf._attn_implementation = kernel
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf).train()


@pytest.fixture
def eager_backend(monkeypatch):
    """`torch.compile` with dynamo's `eager` backend (what compile_layers calls it with, otherwise)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def run(model, compiled: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each micro-batch's logits and the first layer's q_proj gradient, under bf16 autocast (the learner's
    `bf16_mixed`; torch_varlen takes bf16)."""
    if compiled:
        compile_layers(model.model.layers)
    out = []
    for ids, pos, kwargs in micro_batches(model.config.vocab_size):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits.float()
        logits.square().mean().backward()
        out.append((logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
        GRAPHS.append(counters["stats"]["unique_graphs"])
    return out


GRAPHS: list[int] = []  # the graphs compiled so far, after each micro-batch of `run`


def test_torch_varlen_layers_compile_once_for_every_count_of_sequences(eager_backend, monkeypatch):
    monkeypatch.setattr(attention, "varlen_attn", stand_in_varlen_attn)
    monkeypatch.setattr(attention, "VARLEN_KEYWORDS", frozenset({"scale", "is_causal", "enable_gqa"}))
    want = run(qwen3("sdpa_varlen"), compiled=False)  # the per-sequence kernel, eager
    got = run(qwen3(attention.TORCH_VARLEN), compiled=True)
    # 4 layers x 12 micro-batches of 10 distinct counts (> dynamo's recompile limit of 8) ran through one
    # graph (the same code object serves every layer): no count compiled anew
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (lw, gw), (lg, gg) in zip(want, got, strict=True):
        torch.testing.assert_close(lg, lw, atol=2e-2, rtol=2e-2)  # bf16 matmuls, another attention order
        torch.testing.assert_close(gg, gw, atol=2e-3, rtol=5e-2)


def test_the_per_sequence_kernel_compiled_stays_outside_the_graph(eager_backend):
    """`sdpa_varlen` (the CPU kernel) compiled: its loop over host lengths runs outside the graphs, so the
    graphs do not grow with new counts either (the layer is cut in two at attention)."""
    GRAPHS.clear()
    run(qwen3("sdpa_varlen"), compiled=True)
    # the parts before and after attention, each with its first shape and its dynamic generalisation; then
    # 9 more counts of sequences compile nothing
    assert GRAPHS[2] <= 6 and GRAPHS[-1] == GRAPHS[2], GRAPHS


def test_packed_kwargs_hold_the_lengths_on_the_host():
    kw = attention.packed_kwargs([3, 1, 4], torch.device("cpu"))
    assert kw["packed_seq_lens"].device.type == "cpu" and kw["packed_seq_lens"].tolist() == [3, 1, 4]
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 4, 8] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["max_length_q"] == 4 and isinstance(kw["max_length_q"], int)
