"""The attention kernels the learner's models run on packed rows, and `resolve`, which picks one.

A packed micro-batch is one row of whole sequences, `position_ids` restarting at 0 for each; the model
is called with `attention_mask=None` and the sequences' lengths (`packed_kwargs`). How attention stays
inside each sequence depends on the kernel:

- `flash_attention_2` / `flash_attention_3` (CUDA, where the package is installed): variable-length
  kernels on `cu_seq_lens_q/k` (transformers' own packed path).
- `torch_varlen` (ours, CUDA): PyTorch's own variable-length FlashAttention
  (`torch.nn.attention.varlen.varlen_attn`) on the whole row in one call: no loop over sequences, grouped
  query attention without copies of K and V, sliding windows inside the kernel. Inputs in fp32 (autocast
  leaves RoPE's output in fp32) are cast to the autocast dtype; fp32 without autocast, attention dropout,
  or a window on a torch whose `varlen_attn` takes none run `sdpa_varlen`'s loop instead (right, slower).
- `sdpa_varlen` (ours, everywhere): PyTorch's `scaled_dot_product_attention` causally on each sequence of
  the row in turn (`enable_gqa`: no K/V copies; FlashAttention inside PyTorch on CUDA); a sequence longer
  than the layer's sliding window gets the banded causal mask. The portable kernel (CPU).
- `sdpa`, `eager`, `flex_attention`: the block-diagonal causal mask that transformers builds from the
  restarting `position_ids` (exact; `sdpa` and `eager` compute the whole row's T x T scores).

The sequences' lengths reach the kernels as `packed_seq_lens`, a host (CPU) int64 tensor, not a tuple:
under `compile_layers` a tuple is guarded by its length, and every micro-batch with another number of
sequences compiled the layer again until dynamo's recompile limit (8) left the rest of the run eager; a
tensor's length is a dynamic dimension. `sdpa_varlen`'s loop over them runs outside the compiled graph.

Ours compute sliding-window attention (Mistral's, Qwen2/3's `sliding_window`, Gemma-2/3's local layers) and
refuse attention-logit soft-capping (Gemma-2's `attn_logit_softcapping`) by name: `eager` computes it.
With a padded batch (an attention mask) both are transformers' `sdpa`.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from offpolicy.learner.config import AttnImplementation

try:  # PyTorch's own variable-length attention (torch >= 2.10; its keywords differ between releases)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

SDPA_VARLEN = "sdpa_varlen"
TORCH_VARLEN = "torch_varlen"
VARLEN_KEYWORDS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn else frozenset()
"""The keywords this torch's `varlen_attn` takes: `window_size` (causal and windowed attention as (left,
right)) or the older `is_causal`; `enable_gqa` where it checks head counts (FlashAttention itself takes
fewer K/V heads than query heads)."""


def torch_varlen_available() -> bool:
    """Whether this torch has a `varlen_attn` whose causal form we know and is built with CUDA."""
    return torch.cuda.is_available() and bool(VARLEN_KEYWORDS & {"window_size", "is_causal"})


def resolve(name: AttnImplementation, device: torch.device) -> str:
    """The kernel `name` means on `device`: `auto` = on CUDA FlashAttention 3 or 2 where installed, else
    `torch_varlen` where this torch has it, else `sdpa_varlen`; `sdpa_varlen` on CPU. A kernel that cannot
    run here is refused, naming what it needs."""
    packages = {"flash_attention_3": "flash_attn_interface", "flash_attention_2": "flash_attn"}
    if name == "auto":
        if device.type != "cuda":
            return SDPA_VARLEN
        for kernel, package in packages.items():
            if importlib.util.find_spec(package) is not None:
                return kernel
        return TORCH_VARLEN if torch_varlen_available() else SDPA_VARLEN
    if name in packages and importlib.util.find_spec(packages[name]) is None:
        raise ValueError(
            f"attn_implementation={name!r} needs the {packages[name]!r} package: install it, or use "
            "'auto' or 'sdpa_varlen'"
        )
    if name == TORCH_VARLEN and (device.type != "cuda" or not torch_varlen_available()):
        raise ValueError(
            f"attn_implementation='torch_varlen' needs CUDA and torch.nn.attention.varlen.varlen_attn "
            f"(device {device.type}, torch {torch.__version__}): use 'auto' or 'sdpa_varlen'"
        )
    return name


def packed_kwargs(seq_lens: Sequence[int], device: torch.device) -> dict[str, Any]:
    """What the model's forward takes for one packed row of sequences of `seq_lens` tokens: FlashAttention's
    cumulative lengths and maxima, and the lengths as a host int64 tensor for `sdpa_varlen` (no device
    sync; a tensor, not a tuple, so that a compiled layer does not recompile per number of sequences)."""
    lens = torch.tensor([int(n) for n in seq_lens], dtype=torch.int64)  # (n,) on the host
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(device=device, dtype=torch.int32)  # (n + 1,)
    longest = int(lens.max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "packed_seq_lens": lens,
    }


def _refuse_softcap(module: torch.nn.Module, softcap: float | None, kernel: str) -> None:
    """Attention-logit soft-capping is not computed by our kernels: refused, naming the model's setting."""
    if softcap is not None:
        setting = getattr(getattr(module, "config", None), "attn_logit_softcapping", softcap)
        raise ValueError(
            f"attn_implementation={kernel!r} does not apply attention-logit soft-capping, which this model "
            f"uses (config.attn_logit_softcapping={setting}): use attn_implementation='eager'"
        )


def sdpa_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    packed_seq_lens: torch.Tensor | Sequence[int] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention on each packed sequence (query (1, H, T, D), key and value (1, Hkv, T, D)) -> (1, T,
    H, D). Without `packed_seq_lens` (a padded batch) it is transformers' `sdpa` on the given mask."""
    _refuse_softcap(module, softcap, SDPA_VARLEN)
    if packed_seq_lens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return _each_sequence(query, key, value, packed_seq_lens, dropout, scaling, sliding_window), None


@torch.compiler.disable  # a loop over host lengths: traced, it would be a graph per list of lengths
def _each_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[int],
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """`sdpa_varlen`'s loop: SDPA causally on each sequence of the row -> (1, T, H, D). The row is cut by
    one `split` per tensor, whose backward is one concatenation: slicing each sequence out on its own made
    a zero tensor of the whole row per sequence in the backward (bytes growing with sequences x tokens)."""
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    gqa = query.shape[1] != key.shape[1]
    parts = []
    for q, k, v in zip(*(t.split(lens, dim=2) for t in (query, key, value)), strict=True):
        n = q.shape[2]  # (1, H or Hkv, n, D) each
        if sliding_window is not None and n > sliding_window:
            i = torch.arange(n, device=q.device)
            band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)  # (n, n)
            out = scaled_dot_product_attention(
                q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        else:
            out = scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
            )
        parts.append(out)  # (1, H, n, D)
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()  # (1, T, H, D)


def torch_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    packed_seq_lens: torch.Tensor | Sequence[int] | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention on the whole packed row in one `varlen_attn` call (query (1, H, T, D), key and value
    (1, Hkv, T, D)) -> (1, T, H, D); the cases it cannot take go to `sdpa_varlen_attention`."""
    _refuse_softcap(module, softcap, TORCH_VARLEN)
    dtype = query.dtype
    if dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)  # what SDPA would compute in under autocast
    windowed = sliding_window is not None and "window_size" not in VARLEN_KEYWORDS
    if packed_seq_lens is None or dtype == torch.float32 or dropout or windowed:
        return sdpa_varlen_attention(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
            packed_seq_lens, **kwargs,
        )  # fmt: skip
    assert cu_seq_lens_q is not None and max_length_q is not None, "packed_kwargs gives both"
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # (T, H or Hkv, D)
    options: dict[str, Any] = {"scale": scaling}
    if "window_size" in VARLEN_KEYWORDS:  # (left, right): (-1, 0) causal; (W - 1, 0) a window of W tokens
        options["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    else:
        options["is_causal"] = True
    if "enable_gqa" in VARLEN_KEYWORDS:
        options["enable_gqa"] = q.shape[1] != k.shape[1]
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, **options)
    return out[None], None  # (1, T, H, D)


def _packed_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """No mask for a packed row (attention stays inside each sequence by construction); `sdpa`'s otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_attention)
AttentionInterface.register(TORCH_VARLEN, torch_varlen_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_VARLEN, _packed_mask)
ALL_MASK_ATTENTION_FUNCTIONS.register(TORCH_VARLEN, _packed_mask)
