"""The attention kernel the learner's models run, and `sdpa_varlen`: PyTorch SDPA over packed sequences.

A packed micro-batch is one row of whole sequences, `position_ids` restarting at 0 for each; the model
is called with `attention_mask=None` and the sequences' lengths (`packed_kwargs`). How attention stays
inside each sequence depends on the kernel:

- `flash_attention_2` / `flash_attention_3` (CUDA, where the package is installed): variable-length
  kernels on `cu_seq_lens_q/k` (transformers' own packed path).
- `sdpa_varlen` (ours, registered into transformers' `AttentionInterface`): PyTorch's
  `scaled_dot_product_attention(is_causal=True)` on each sequence of the row in turn. No mask is built and
  nothing is computed across sequences: the cost is that of the sequences alone, and on CUDA each call
  runs PyTorch's FlashAttention kernel. With a padded batch (an attention mask) it is transformers' `sdpa`.
- `sdpa`, `eager`, `flex_attention`: the block-diagonal causal mask that transformers builds from the
  restarting `position_ids` (exact; `sdpa` and `eager` compute the whole row's T x T scores).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from offpolicy.learner.config import AttnImplementation

SDPA_VARLEN = "sdpa_varlen"


def resolve(name: AttnImplementation, device: torch.device) -> str:
    """The kernel `name` means on `device`: `auto` = FlashAttention 3 or 2 on CUDA where installed, else
    `sdpa_varlen`. A FlashAttention kernel that is not installed is refused here, naming the package."""
    packages = {"flash_attention_3": "flash_attn_interface", "flash_attention_2": "flash_attn"}
    if name == "auto":
        for kernel, package in packages.items():
            if device.type == "cuda" and importlib.util.find_spec(package) is not None:
                return kernel
        return SDPA_VARLEN
    if name in packages and importlib.util.find_spec(packages[name]) is None:
        raise ValueError(
            f"attn_implementation={name!r} needs the {packages[name]!r} package: install it, or use "
            "'auto' or 'sdpa_varlen'"
        )
    return name


def packed_kwargs(seq_lens: Sequence[int], device: torch.device) -> dict[str, Any]:
    """What the model's forward takes for one packed row of sequences of `seq_lens` tokens: FlashAttention's
    cumulative lengths and maxima, and the lengths as host ints for `sdpa_varlen` (no device sync)."""
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(seq_lens)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "packed_seq_lens": tuple(int(n) for n in seq_lens),
    }


def sdpa_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_seq_lens: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention on each packed sequence (query (1, H, T, D), key and value (1, Hkv, T, D)) -> (1, T,
    H, D). Without `packed_seq_lens` (a padded batch) it is transformers' `sdpa` on the given mask."""
    if packed_seq_lens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # (1, H, T, D)
    parts, start = [], 0
    for n in packed_seq_lens:
        end = start + n
        parts.append(
            scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                dropout_p=dropout,
                scale=scaling,
                is_causal=True,
            )
        )  # (1, H, n, D)
        start = end
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None  # (1, T, H, D)


def _sdpa_varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """No mask for a packed row (attention stays inside each sequence by construction); `sdpa`'s otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_VARLEN, _sdpa_varlen_mask)
