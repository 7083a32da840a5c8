"""The LM head's log-probs of the sampled tokens, fused: each chunk's logits are made once and read once.

`head_logprobs(head, h, ids, temps, softcap, entropy)` is one autograd function per chunk of c tokens:

- forward: z = head(h) in the compute dtype (bf16 under autocast), (c, V); then one pass over z in fp32
  gives the log-prob of each sampled token, log pi = z_id / T - logsumexp(z / T), the logsumexp, and with
  `entropy` the entropy of softmax(z / T) (soft-capping `cap * tanh(z / cap)` first, Gemma-2/3's
  `final_logit_softcapping`). Only h, the ids and per-token scalars are kept for the backward pass.
- backward: z is recomputed from h (one more matmul, as activation checkpointing of the head did), and one
  pass gives dL/dz = (g_lp (onehot - p) - g_H p (log p + H)) / T (times the cap's tanh derivative), in the
  compute dtype, then dL/dh = dL/dz W and dL/dW = dL/dz^T h.

On CUDA (with Triton) the two passes over z are compiled by `torch.compile` into single kernels: no fp32
copy of the logits, no tempered copy at any temperature; elsewhere they run eagerly, in place on one fp32
copy. The numbers are those of the `chunked` head of learner/model/policy.py (fp32 logits of bf16 matmuls).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.functional import linear


def _forward_pass(
    z: torch.Tensor, ids: torch.Tensor, temps: torch.Tensor, softcap: float | None, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-probs (c,), logsumexp (c,), entropy (c,) or None) of logits z (c, V) at temperatures (c, 1)."""
    x = z.to(torch.promote_types(z.dtype, torch.float32), copy=True)  # (c, V): the one fp32 copy
    if softcap is not None:
        x = x.div_(softcap).tanh_().mul_(softcap)
    x = x.div_(temps)
    lse = torch.logsumexp(x, dim=-1)  # (c,)
    logp = x.gather(-1, ids[:, None])[:, 0] - lse
    if not entropy:
        return logp, lse, None
    return logp, lse, lse - torch.linalg.vecdot(torch.exp(x - lse[:, None]), x)  # lse - sum p x


def _backward_pass(
    z: torch.Tensor,
    ids: torch.Tensor,
    temps: torch.Tensor,
    softcap: float | None,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
) -> torch.Tensor:
    """dL/dz (c, V) in z's dtype from the gradients of the log-probs and entropies (c,)."""
    x = z.to(torch.promote_types(z.dtype, torch.float32), copy=True)  # (c, V)
    if softcap is not None:
        cap = x.div_(softcap).tanh_()  # tanh(z / cap), kept for its derivative
        x = cap * softcap
    x = x.div_(temps).sub_(lse[:, None])  # log p
    p = torch.exp(x)
    if ent is not None and g_ent is not None:  # -(g_H (log p + H) + g_lp) p
        grad = x.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
    else:
        grad = p.mul_(-g_lp[:, None])
    grad = grad.scatter_add_(-1, ids[:, None], g_lp[:, None]).div_(temps)  # + g_lp onehot; d(z/T)/dz
    if softcap is not None:
        grad = grad.mul_(1 - cap * cap)  # d(cap tanh(z / cap))/dz
    return grad.to(z.dtype)


def _passes(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two passes over the logits for `device`: compiled on CUDA where Triton is there, else eager."""
    from torch.utils._triton import has_triton

    if device.type == "cuda" and has_triton():
        return _compiled()
    return _forward_pass, _backward_pass


@functools.cache
def _compiled() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two passes compiled once per process (each compiles on its first call, per dtype and flags)."""
    return torch.compile(_forward_pass, dynamic=True), torch.compile(_backward_pass, dynamic=True)


class _HeadLogProbs(torch.autograd.Function):
    """Log-probs (c,) and entropies (c,) or None of `ids` (c,) from states h (c, H) through the head."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ids: torch.Tensor,
        temps: torch.Tensor,
        softcap: float | None,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kind = h.device.type
        ctx.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.softcap = softcap
        z = linear(h, weight, bias)  # (c, V) in the compute dtype (autocast's, when on)
        logp, lse, ent = _passes(h.device)[0](z, ids, temps, softcap, entropy)
        ctx.save_for_backward(h, weight, bias, ids, temps, lse, ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        h, weight, bias, ids, temps, lse, ent = ctx.saved_tensors
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
        g_ent = None if g_ent is None else g_ent.float()
        enabled, dtype = ctx.autocast
        with torch.autocast(h.device.type, dtype=dtype, enabled=enabled):  # the forward's casts again
            z = linear(h, weight, bias)  # (c, V)
            gz = _passes(h.device)[1](z, ids, temps, ctx.softcap, lse, ent, g_lp, g_ent)  # (c, V)
            grad_h = torch.matmul(gz, weight) if ctx.needs_input_grad[0] else None  # (c, H)
            grad_w = torch.matmul(gz.t(), h) if ctx.needs_input_grad[1] else None  # (V, H)
        grad_b = gz.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return (
            None if grad_h is None else grad_h.to(h.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None, None,
        )  # fmt: skip


def head_logprobs(
    head: nn.Module,
    h: torch.Tensor,
    ids: torch.Tensor,
    temps: torch.Tensor,
    softcap: float | None,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (..., c) of `ids` (..., c) and with `entropy` the entropies (..., c) of the tempered
    distribution, from states h (..., c, H) through the linear `head`; `temps` broadcasts against (..., c).
    Both fp32."""
    lead = ids.shape
    flat_temps = temps.expand(*lead, 1).reshape(-1, 1).float()  # (n, 1)
    logp, ent = _HeadLogProbs.apply(
        h.reshape(-1, h.shape[-1]), head.weight, head.bias, ids.reshape(-1), flat_temps, softcap, entropy
    )
    return logp.view(lead), None if ent is None else ent.view(lead)
