"""Turn trajectory groups into padded tensors, and compute the log-probs of exactly the sampled tokens.

Layout (the same for every row): the prompt is LEFT-padded to the batch's longest prompt `P`, the
response is RIGHT-padded to the longest response `R`, so every response starts at column `P` and
`input_ids` is (B, P + R). Position ids restart at 0 on each row's first real prompt token, as in vLLM.

`token_logprobs` applies each row's sampling temperature to the logits (logits / T, then log-softmax),
which is what vLLM reports with `logprobs_mode="processed_logprobs"`. Deliberately simplified: top-p and
top-k truncation are not modelled; actors that feed the learner should sample with top_p=1, top_k=-1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.utils.checkpoint

from learner.errors import BatchError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from buffer.types import TrajectoryGroup


@dataclass(slots=True)
class Batch:
    """One sampled batch as padded tensors; `None` fields are filled in by the train loop."""

    input_ids: torch.Tensor  # (B, P+R) long: left-padded prompt, then right-padded response
    attention_mask: torch.Tensor  # (B, P+R) long: 1 on real prompt and response tokens
    position_ids: torch.Tensor  # (B, P+R) long: 0 at each row's first prompt token
    response_ids: torch.Tensor  # (B, R) long: the sampled token ids (pad after the end)
    response_mask: torch.Tensor  # (B, R) float: 1 on tokens the loss uses (rejection sampling may clear some)
    sampled_mask: (
        torch.Tensor
    )  # (B, R) float: 1 on every sampled token (never changed; GAE and critic use it)
    rollout_log_probs: torch.Tensor  # (B, R) float: behaviour log-probs (0 on padding)
    rewards: torch.Tensor  # (B,) float: one scalar reward per completion
    group_index: torch.Tensor  # (B,) long: 0..G-1, which group each row belongs to
    policy_versions: (
        torch.Tensor
    )  # (B,) long: the row's oldest token version (its staleness is measured from it)
    behavior_versions: torch.Tensor  # (B, R) long: per-token version (the group's, unless it spans a reload)
    temperatures: torch.Tensor  # (B,) float: the sampling temperature of each row's group
    prompt_width: int  # P: column where every response starts
    # Filled in by the loop (spec §5.1):
    old_log_probs: torch.Tensor | None = None  # (B, R) pi_old (decoupled) or pi_rollout (bypass)
    advantages: torch.Tensor | None = None  # (B, R)
    is_weights: torch.Tensor | None = None  # (B, R) decoupled IS weights, detached
    returns: torch.Tensor | None = None  # (B, R) GAE returns (critic targets)
    values: torch.Tensor | None = None  # (B, R) critic values at sampling time

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on `device`."""
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self._tensors().items()})

    def select(self, rows: torch.Tensor) -> Batch:
        """The rows `rows` (long index), with columns that are padding in all of them trimmed away."""
        sub = {k: v[rows] for k, v in self._tensors().items()}
        prompt_mask = sub["attention_mask"][:, : self.prompt_width]  # (b, P)
        drop_left = int((prompt_mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-pad columns
        keep_r = int(sub["sampled_mask"].sum(0).nonzero().max()) + 1 if sub["sampled_mask"].any() else 1
        for k, v in sub.items():
            if v.dim() == 2 and v.shape[1] == self.input_ids.shape[1]:
                sub[k] = v[:, drop_left : self.prompt_width + keep_r]
            elif v.dim() == 2:
                sub[k] = v[:, :keep_r]
        return dataclasses.replace(self, prompt_width=self.prompt_width - drop_left, **sub)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }


def collate(groups: Sequence[TrajectoryGroup], pad_token_id: int) -> Batch:
    """Pad the completions of `groups` into one `Batch` (rows in group order, then completion order)."""
    if not groups:
        raise BatchError("collate needs at least one group")
    rows = [(gi, g, t) for gi, g in enumerate(groups) for t in g.trajectories]
    for _, g, t in rows:
        if g.sampling.temperature <= 0:
            raise BatchError(
                f"group {g.group_id}: temperature {g.sampling.temperature} has no sampling log-probs"
            )
        if len(t.response_ids) == 0 or len(t.response_ids) != len(t.behavior_logprobs):
            raise BatchError(
                f"group {g.group_id}: {len(t.response_ids)} response ids, "
                f"{len(t.behavior_logprobs)} behaviour log-probs"
            )
    B = len(rows)
    P = max(len(g.prompt_ids) for _, g, _ in rows)
    R = max(len(t.response_ids) for _, _, t in rows)
    ids = np.full((B, P + R), pad_token_id, dtype=np.int64)
    attn = np.zeros((B, P + R), dtype=np.int64)
    lp = np.zeros((B, R), dtype=np.float32)
    bver = np.zeros((B, R), dtype=np.int64)
    for b, (_, g, t) in enumerate(rows):
        p, r = len(g.prompt_ids), len(t.response_ids)
        ids[b, P - p : P] = g.prompt_ids
        ids[b, P : P + r] = t.response_ids
        attn[b, P - p : P + r] = 1
        lp[b, :r] = t.behavior_logprobs
        bver[b, :r] = g.policy_version if t.versions is None else t.versions
    oldest = [  # a completion's staleness counts from its oldest token (what max_staleness bounds)
        g.policy_version if t.versions is None or len(t.versions) == 0 else int(t.versions.min())
        for _, g, t in rows
    ]
    input_ids, attention_mask = torch.from_numpy(ids), torch.from_numpy(attn)
    response_mask = attention_mask[:, P:].float()  # (B, R)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        response_ids=input_ids[:, P:].clone(),
        response_mask=response_mask,
        sampled_mask=response_mask.clone(),
        rollout_log_probs=torch.from_numpy(lp) * response_mask,
        rewards=torch.tensor([float(t.reward) for _, _, t in rows], dtype=torch.float32),
        group_index=torch.tensor([gi for gi, _, _ in rows], dtype=torch.long),
        policy_versions=torch.tensor(oldest, dtype=torch.long),
        behavior_versions=torch.from_numpy(bver),
        temperatures=torch.tensor([g.sampling.temperature for _, g, _ in rows], dtype=torch.float32),
        prompt_width=P,
    )


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


def staleness(batch: Batch, consumer_version: int) -> torch.Tensor:
    """Per-row staleness in optimizer steps: consumer_version - the row's oldest token version, (B,)."""
    return consumer_version - batch.policy_versions


def token_staleness(batch: Batch, consumer_version: int) -> torch.Tensor:
    """Per-token age in optimizer steps: consumer_version - the version that sampled each token, (B, R)."""
    return consumer_version - batch.behavior_versions
