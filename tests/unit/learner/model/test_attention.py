"""Our attention kernels on CPU: the packed row gives the padded rows' log-probs and gradients with grouped
query attention (no K/V copies) and with sliding windows; soft-capping and kernels that cannot run here are
refused by name. The CUDA kernel (`torch_varlen`) is tested in tests/gpu/test_learner_kernels_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from offpolicy.learner.batch import collate
from offpolicy.learner.model import attention, token_logprobs
from tests.unit.learner.rl.test_microbatches import ragged_groups


def mistral(attn: str, window: int | None) -> MistralForCausalLM:
    """A tiny random Mistral: 4 query heads sharing 1 K/V head, a sliding window of `window` tokens."""
    cfg = MistralConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=window, max_position_embeddings=256,
    )  # fmt: skip
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return MistralForCausalLM(cfg).float()


def packed_and_padded(model, padded_attn: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(packed, padded) log-probs of one ragged batch and the largest gradient difference between them."""
    batch = collate(ragged_groups(3, 3, seed=4, prompt=(3, 12), response=(1, 30)), pad_token_id=0)
    grads, out = [], []
    for packed in (True, False):
        model.set_attn_implementation(attention.SDPA_VARLEN if packed else padded_attn)
        model.zero_grad()
        lp = token_logprobs(model, batch, chunk_tokens=7, packed=packed)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        out.append(lp.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    diff = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    return out[0], out[1], diff


def test_grouped_query_attention_needs_no_copies_and_matches_the_padded_rows():
    packed, padded, grad_diff = packed_and_padded(mistral(attention.SDPA_VARLEN, None), "sdpa")
    assert (packed - padded).abs().max() <= 1e-5
    assert grad_diff <= 1e-5


def test_a_sliding_window_is_computed_as_transformers_masks_it():
    """Sequences of up to 42 tokens, a window of 6: the packed row equals the padded rows under
    transformers' own sliding-window mask (`eager`), and differs from full attention."""
    windowed, padded, grad_diff = packed_and_padded(mistral(attention.SDPA_VARLEN, 6), "eager")
    assert (windowed - padded).abs().max() <= 1e-5
    assert grad_diff <= 1e-5
    full, _, _ = packed_and_padded(mistral(attention.SDPA_VARLEN, None), "eager")
    assert (windowed - full).abs().max() > 1e-3  # the window matters for these lengths


def test_attention_soft_capping_is_refused_naming_the_setting():
    cfg = Gemma2Config(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, attn_logit_softcapping=50.0, sliding_window=16,
    )  # fmt: skip
    cfg._attn_implementation = attention.SDPA_VARLEN
    model = Gemma2ForCausalLM(cfg)
    batch = collate(ragged_groups(1, 2, seed=1), pad_token_id=0)
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50\.0.*'eager'"):
        token_logprobs(model, batch, packed=True)


def test_resolve_picks_what_runs_here_and_refuses_the_rest():
    cpu = torch.device("cpu")
    assert attention.resolve("auto", cpu) == attention.SDPA_VARLEN
    assert attention.resolve("eager", cpu) == "eager"
    with pytest.raises(ValueError, match=r"torch_varlen.*needs CUDA and torch\.nn\.attention\.varlen"):
        attention.resolve("torch_varlen", cpu)


def test_torch_varlen_hands_what_it_cannot_take_to_the_per_sequence_kernel():
    """fp32 without autocast (FlashAttention takes bf16/fp16 only): the same numbers as `sdpa_varlen`."""
    model = mistral(attention.TORCH_VARLEN, 6)
    batch = collate(ragged_groups(2, 2, seed=2, response=(1, 30)), pad_token_id=0)
    with torch.no_grad():
        ours = token_logprobs(model, batch, packed=True)
        model.set_attn_implementation(attention.SDPA_VARLEN)
        loop = token_logprobs(model, batch, packed=True)
    assert torch.equal(ours, loop)


class _Written(TorchDispatchMode):
    """Bytes of every operator's outputs (what it writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def test_the_per_sequence_kernel_backward_writes_bytes_of_the_row_not_of_sequences_times_the_row():
    """512 tokens as 2 or as 64 sequences: the backward writes about the same bytes. Each sequence sliced
    out on its own made a zero tensor of the whole row per sequence in the backward (64 sequences: ~20x
    the bytes of 2); one split per tensor has a one-concatenation backward."""
    written = {}
    for n in (2, 64):
        lens = [512 // n] * n
        q, k, v = (torch.randn(1, h, 512, 32, requires_grad=True) for h in (8, 2, 2))
        out, _ = attention.sdpa_varlen_attention(torch.nn.Module(), q, k, v, None, packed_seq_lens=lens)
        grad = torch.randn_like(out)
        with _Written() as mode:
            torch.autograd.grad(out, (q, k, v), grad)
        written[n] = mode.bytes
    assert written[64] < 1.5 * written[2], written
