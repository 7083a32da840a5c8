"""The policy's forward: log-probs of exactly the sampled tokens, at each row's temperature.

`token_logprobs` applies each row's sampling temperature to the logits (logits / T, then log-softmax),
which is what vLLM reports with `logprobs_mode="processed_logprobs"`; `token_stats` also gives the entropy
of that tempered distribution at each response token (the entropy bonus), from the same chunks of logits.
Deliberately simplified: top-p and top-k truncation are not modelled; actors that feed the learner should
sample with top_p=1, top_k=-1.

`LogProbs` wraps a causal LM as the module the learner calls (one process or N): under FSDP2 the root's
parameters (embeddings, final norm, LM head, tied or not) are all-gathered by its own pre-forward hook.

Two layouts of a micro-batch, the same log-probs: padded rows (`packed=False`: the batch as collated,
left-padded prompts, right-padded responses) or one packed row (`packed=True`, `pack`): the real tokens of
every row concatenated, `position_ids` restarting at 0 for each sequence, attention confined to each
(learner/model/attention.py); the states that predict the sampled tokens are gathered from it, the LM head
runs on those alone, and the log-probs are scattered back to the (row, response position) layout the
correction and the losses use. A batch whose rows show images (a vision-language policy) always takes
the padded layout (learner/model/vision.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch import nn

from offpolicy.learner.model.attention import packed_kwargs
from offpolicy.learner.model.head import head_logprobs
from offpolicy.learner.model.moe import (
    RouterLogits,
    experts_per_token,
    forward_routes,
    response_layout,
    response_routes,
    router_losses,
)
from offpolicy.learner.model.vision import decoder_states

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from offpolicy.learner.batch import Batch
    from offpolicy.learner.config import LogprobHead


class LogProbs(nn.Module):
    """`forward(batch, chunk_tokens, packed, entropy)` = `token_stats(lm, ..., head=head)`: (log-probs
    (B, R), entropy (B, R) or None); `head` = `fused` (learner/model/head.py) or `chunked`.

    `router` (an MoE policy: model/moe.py `RouterLogits` of `lm`): each forward with gradients also leaves
    its router losses in `router_losses` ((load balancing, z-loss), 0-d fp32 tensors in the graph), read
    by the loss right after (learner/rl/update.py); None after a pass without gradients or for a dense
    policy. The log-prob path is the same either way.

    Routing replay (model/moe.py `RouterLogits`): a batch's `replay_experts` are replayed, else its
    `routed_experts` (the rollout's) only compared; `router_agreement` is then (2,) long (token-layers whose
    own top-k equals the given one, token-layers with a row) after each forward, else None, and
    `router_agreement_tokens` (b, R) float the share of layers agreeing at each response-predicting
    position (0 where the position has no row: read it under the rows' mask). With
    `recording` True, each forward leaves its own choices in `routes` ((b, R, L, K) long), else None."""

    def __init__(
        self, lm: nn.Module, head: LogprobHead = "fused", router: RouterLogits | None = None
    ) -> None:
        super().__init__()
        self.lm = lm
        self.logprob_head = head
        self.router = router
        self.router_losses: tuple[torch.Tensor, torch.Tensor] | None = None
        self.router_agreement: torch.Tensor | None = None
        self.router_agreement_tokens: torch.Tensor | None = None
        self.recording = False
        self.routes: torch.Tensor | None = None

    def forward(
        self, batch: Batch, chunk_tokens: int, packed: bool = False, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.router_losses = self.router_agreement = self.router_agreement_tokens = self.routes = None
        if self.router is None:
            return token_stats(self.lm, batch, chunk_tokens, packed, entropy, self.logprob_head)
        given = batch.replay_experts if batch.replay_experts is not None else batch.routed_experts
        flat = None if given is None else forward_routes(batch, given.to(batch.input_ids.device), packed)
        self.router.set_routes(flat, batch.replay_experts is not None)  # kept for the backward's recompute
        with self.router.counting(self.recording):
            if not torch.is_grad_enabled():
                out = token_stats(self.lm, batch, chunk_tokens, packed, entropy, self.logprob_head)
            else:
                with self.router.collect() as logits:  # one (T, E) per sparse layer
                    out = token_stats(self.lm, batch, chunk_tokens, packed, entropy, self.logprob_head)
                mask = None if packed else batch.attention_mask.reshape(-1)  # (B * L,): padded layout's
                self.router_losses = router_losses(logits, experts_per_token(self.lm.config), mask)
        self.router_agreement = self.router.agreement
        if self.router.token_agreement is not None:  # (T,) -> (b, R): share of layers agreeing per token
            layers = len(self.router.routers)
            share = self.router.token_agreement.float() / layers
            self.router_agreement_tokens = response_layout(share, batch, packed, fill=0)  # (b, R)
        if self.recording:
            self.routes = response_routes(self.router.record or [], batch, packed)
        return out


# --- the packed layout


@dataclass(frozen=True, slots=True)
class Packed:
    """A micro-batch's sequences as one row without padding, and where its sampled tokens sit in it."""

    input_ids: torch.Tensor  # (1, T) long: every row's real tokens, row after row
    position_ids: torch.Tensor  # (1, T) long: 0 at each sequence's first token
    kwargs: dict[str, Any]  # the sequences' lengths for the attention kernel (`packed_kwargs`)
    sampled: torch.Tensor  # (b, R) bool: the sampled response tokens of the padded layout
    predictors: torch.Tensor  # (N,) long: position in the row of the state predicting each sampled token


def pack(batch: Batch) -> Packed:
    """The packed row of `batch`'s sequences (their order kept); one host sync, for the lengths."""
    real = batch.attention_mask.bool()  # (b, L)
    where = real.flatten().cumsum(0).view(real.shape) - 1  # (b, L): each real token's position in the row
    R = batch.response_ids.shape[1]
    sampled = batch.sampled_mask > 0  # (b, R)
    predictors = where[:, batch.prompt_width - 1 : batch.prompt_width - 1 + R][sampled]  # (N,)
    lengths = real.sum(-1).tolist()
    return Packed(
        input_ids=batch.input_ids[real][None],
        position_ids=batch.position_ids[real][None],
        kwargs=packed_kwargs(lengths, batch.input_ids.device),
        sampled=sampled,
        predictors=predictors,
    )


def sampled_states(decoder: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's last hidden states that predict each sampled token, run on the packed row: (N, H),
    and the (b, R) mask of where those tokens sit (`unpack` scatters per-token results back)."""
    p = pack(batch)
    hidden = decoder(
        input_ids=p.input_ids, attention_mask=None, position_ids=p.position_ids, use_cache=False, **p.kwargs
    ).last_hidden_state[0]  # (T, H)
    return hidden[p.predictors], p.sampled  # (N, H)


def unpack(values: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Per-token `values` (N,) back to the (b, R) layout, 0 where no token was sampled (differentiable)."""
    return torch.zeros(sampled.shape, dtype=values.dtype, device=values.device).masked_scatter(
        sampled, values
    )


# --- log-probs


def response_hidden_states(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Last hidden states at the positions that predict the response tokens: (B, R, H); no logits built.
    Rows that show images run through the vision-language forward (learner/model/vision.py)."""
    R = batch.response_ids.shape[1]
    if batch.images is not None:
        hidden = decoder_states(model, batch)  # (B, P+R, H)
        return hidden[:, batch.prompt_width - 1 : batch.prompt_width - 1 + R]
    hidden = model.get_decoder()(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state  # (B, P+R, H)
    return hidden[:, batch.prompt_width - 1 : batch.prompt_width - 1 + R]  # (B, R, H): P-1 .. P+R-2


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(z) over the last axis, (..., V) -> (...), with a backward that keeps at most two
    (..., V) tensors alive: dH/dz = -p (z - lse + H), p = exp(z - lse) (autograd through softmax and a
    product would keep four or five at 150k vocabulary x 4096 tokens)."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(z, dim=-1)  # (...)
        h = lse - torch.linalg.vecdot(torch.exp(z - lse[..., None]), z)  # (...): lse - sum p z
        ctx.save_for_backward(z, lse, h)
        return h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        z, lse, h = ctx.saved_tensors
        out = z - (lse - h)[..., None]  # (..., V): z - lse + H
        out.mul_(torch.exp(z - lse[..., None]))
        return out.mul_(-grad[..., None])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) over the last axis, (..., V) -> (...) (verl's
    `entropy_from_logits`: logsumexp - sum(softmax * logits)); differentiable with a lean backward."""
    return _Entropy.apply(logits)


def _chunk_stats(
    head: torch.nn.Module,
    softcap: float | None,
    h: torch.Tensor,
    ids: torch.Tensor,
    temps: torch.Tensor,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log-softmax-and-gather of one chunk: (..., c, H) states, (..., c) ids, temperatures broadcasting
    against the logits ((b, 1, 1) padded, (c, 1) packed) -> log-probs (..., c), and with `entropy` the
    entropy (..., c) of the same tempered distribution."""
    logits = head(h).float()  # (..., c, V): the only fp32 logits alive at a time
    if softcap is not None:  # Gemma-2/3 final logit soft-capping, applied before the temperature
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temps
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (b, c)
    return picked - torch.logsumexp(logits, dim=-1), entropy_from_logits(logits) if entropy else None


def token_logprobs(
    model: PreTrainedModel,
    batch: Batch,
    chunk_tokens: int = 4096,
    packed: bool = False,
    head: LogprobHead = "fused",
) -> torch.Tensor:
    """log pi(response token | prefix) under `model` at each row's temperature: (B, R), 0 on padding.

    The LM head runs on chunks of response positions holding at most `chunk_tokens` tokens of the
    micro-batch, so the logits of a whole micro-batch (B x R x V: 4.9 GiB in fp32 at 8 x 1024 tokens and a
    152k vocabulary) are never materialised. With gradients on, each chunk's logits are recomputed in the
    backward pass: only the hidden states are kept between the passes. `head`: `fused` makes each
    chunk's logits once and reads them once (learner/model/head.py); `chunked` is the earlier head (an
    fp32 copy and a tempered copy of each chunk, the chunk under activation checkpointing).
    `packed`: the decoder runs on the packed row and the head on the sampled tokens alone.
    """
    return token_stats(model, batch, chunk_tokens, packed, head=head)[0]


def token_stats(
    model: PreTrainedModel,
    batch: Batch,
    chunk_tokens: int = 4096,
    packed: bool = False,
    entropy: bool = False,
    head: LogprobHead = "fused",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`, and with `entropy` the entropy of the policy's tempered distribution at each
    response position, (B, R), 0 where the log-probs are 0: computed from the same chunks of logits."""
    stats_of = head_logprobs if head == "fused" else _checkpointed_stats
    head_module = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if packed and batch.images is None:  # rows with images: the padded layout (3-row positions)
        states, sampled = sampled_states(model.get_decoder(), batch)  # (N, H), (B, R)
        ids = batch.response_ids[sampled]  # (N,)
        temps = batch.temperatures.to(states.device)[:, None].expand(sampled.shape)[sampled][
            :, None
        ]  # (N, 1)
        chunks = [
            stats_of(
                head_module,
                states[s : s + chunk_tokens],
                ids[s : s + chunk_tokens],
                temps[s : s + chunk_tokens],
                softcap,
                entropy,
            )
            for s in range(0, max(1, states.shape[0]), chunk_tokens)  # one (empty) chunk for an idle pass
        ]
        return tuple(  # type: ignore[return-value]
            None if parts[0] is None else unpack(torch.cat(parts), sampled) * batch.response_mask
            for parts in zip(*chunks, strict=True)
        )  # (B, R) each
    hidden = response_hidden_states(model, batch)  # (B, R, H)
    temps = batch.temperatures.to(hidden.device)[:, None, None]  # (B, 1, 1)
    width = max(1, chunk_tokens // hidden.shape[0])  # response positions per chunk
    chunks = [
        stats_of(
            head_module,
            hidden[:, s : s + width],
            batch.response_ids[:, s : s + width],
            temps,
            softcap,
            entropy,
        )
        for s in range(0, hidden.shape[1], width)
    ]
    return tuple(  # type: ignore[return-value]
        None if parts[0] is None else torch.cat(parts, dim=1) * batch.response_mask
        for parts in zip(*chunks, strict=True)
    )  # (B, R) each


def _checkpointed_stats(
    head: torch.nn.Module,
    h: torch.Tensor,
    ids: torch.Tensor,
    temps: torch.Tensor,
    softcap: float | None,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `chunked` head: `_chunk_stats`, recomputed in the backward pass when gradients are on."""
    if torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(
            _chunk_stats, head, softcap, h, ids, temps, entropy, use_reentrant=False
        )
    return _chunk_stats(head, softcap, h, ids, temps, entropy)
