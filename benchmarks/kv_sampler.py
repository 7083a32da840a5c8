"""A batched, KV-cached torch sampler for the staleness benchmark: many prompts x n completions at once.

`learner/model/tiny.py`'s `sample_completions` re-runs the whole sequence per token, one prompt at a time;
this one left-pads every prompt of a step into one batch and decodes with the model's KV cache. Position
ids restart at 0 on each row's first real prompt token, as in `learner/batch.py`, so the log-probs it
reports are those the learner recomputes (up to float32 rounding). Deliberately simplified: plain
temperature sampling (no top-p / top-k), rows keep decoding after their EOS (the tail is cut off).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

Completion = tuple[list[int], list[float]]
"""(token ids, log-probs at the sampling temperature), ending at the first EOS if any."""


@torch.no_grad()
def sample_groups(
    model: PreTrainedModel,
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    *,
    pad_id: int,
    eos_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[Completion]]:
    """`n` completions of each prompt: one list of `n` (ids, log-probs) per prompt, in prompt order."""
    device = next(model.parameters()).device
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (N, P) left-padded
    attn = torch.zeros((len(rows), width), dtype=torch.long)  # (N, P)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (N, P)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    next_pos = pos[:, -1:] + 1  # (N, 1)
    toks, lps = [], []
    for step in range(max_new_tokens):
        logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)  # (N, V)
        tok = torch.multinomial(logp.exp(), 1, generator=generator)  # (N, 1)
        toks.append(tok[:, 0])
        lps.append(logp.gather(-1, tok)[:, 0])
        if step == max_new_tokens - 1 or bool(torch.stack(toks, 1).eq(eos_id).any(1).all()):
            break
        attn = torch.cat([attn, torch.ones_like(tok)], dim=1)  # (N, P + step + 1)
        out = model(
            input_ids=tok,
            attention_mask=attn,
            position_ids=next_pos,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        next_pos = next_pos + 1
    all_ids, all_lps = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()  # (N, L)
    completions: list[Completion] = []
    for row_ids, row_lps in zip(all_ids, all_lps, strict=True):
        end = row_ids.index(eos_id) + 1 if eos_id in row_ids else len(row_ids)
        completions.append((row_ids[:end], row_lps[:end]))
    return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]
