"""The policy's forward: log-probs of exactly the sampled tokens, at each row's temperature.

`token_logprobs` applies each row's sampling temperature to the logits (logits / T, then log-softmax),
which is what vLLM reports with `logprobs_mode="processed_logprobs"`. Deliberately simplified: top-p and
top-k truncation are not modelled; actors that feed the learner should sample with top_p=1, top_k=-1.

`LogProbs` wraps a causal LM as the module the learner calls (one process or N): under FSDP2 the root's
parameters (embeddings, final norm, LM head, tied or not) are all-gathered by its own pre-forward hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.batch import Batch


class LogProbs(nn.Module):
    """`forward(batch, chunk_tokens)` = `token_logprobs(lm, batch, chunk_tokens)`: (B, R)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, batch: Batch, chunk_tokens: int) -> torch.Tensor:
        return token_logprobs(self.lm, batch, chunk_tokens)


def response_hidden_states(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Last hidden states at the positions that predict the response tokens: (B, R, H); no logits built."""
    R = batch.response_ids.shape[1]
    hidden = model.get_decoder()(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state  # (B, P+R, H)
    return hidden[:, batch.prompt_width - 1 : batch.prompt_width - 1 + R]  # (B, R, H): P-1 .. P+R-2


def _chunk_logprobs(
    head: torch.nn.Module, softcap: float | None, h: torch.Tensor, ids: torch.Tensor, temps: torch.Tensor
) -> torch.Tensor:
    """log-softmax-and-gather of one chunk: (b, c, H) states, (b, c) ids, (b,) temperatures -> (b, c)."""
    logits = head(h).float()  # (b, c, V): the only fp32 logits alive at a time
    if softcap is not None:  # Gemma-2/3 final logit soft-capping, applied before the temperature
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temps[:, None, None]
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (b, c)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(model: PreTrainedModel, batch: Batch, chunk_tokens: int = 4096) -> torch.Tensor:
    """log pi(response token | prefix) under `model` at each row's temperature: (B, R), 0 on padding.

    The LM head runs on chunks of response positions holding at most `chunk_tokens` tokens of the
    micro-batch, so the fp32 logits of a whole micro-batch (B x R x V: 4.9 GiB at 8 x 1024 tokens and a
    152k vocabulary) are never materialised. With gradients on, each chunk is recomputed in the backward
    pass (activation checkpointing of the head): only the hidden states are kept between the passes.
    """
    hidden = response_hidden_states(model, batch)  # (B, R, H)
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    temps = batch.temperatures.to(hidden.device)  # (B,)
    width = max(1, chunk_tokens // hidden.shape[0])  # response positions per chunk
    parts = []
    for s in range(0, hidden.shape[1], width):
        args = (head, softcap, hidden[:, s : s + width], batch.response_ids[:, s : s + width], temps)
        if torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    return torch.cat(parts, dim=1) * batch.response_mask  # (B, R)
