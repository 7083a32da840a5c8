"""The data split of a learner on N ranks: which groups each rank trains on.

A group is never split; groups go to ranks balanced by token count. Every rank holds the same batch, so
every rank computes the same split (and so knows how many passes the others run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def assign_groups(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Group indices per rank, balanced by token count (largest first onto the lightest rank; ties by
    rank), each rank's list in ascending order. Deterministic: every rank computes the same split."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for g in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        out[r].append(g)
        loads[r] += token_counts[g]
    return [sorted(x) for x in out]


def shares(
    rows: torch.Tensor, group_index: torch.Tensor, row_tokens: torch.Tensor, world_size: int
) -> list[torch.Tensor]:
    """Split the (global) row indices `rows` over the ranks: whole groups (`group_index` (B,) maps rows to
    groups), balanced by the groups' token counts (`row_tokens` (B,)). Every rank holds the same batch, so
    every rank computes the same split (and so knows how many micro-batches the others run)."""
    if world_size == 1:
        return [rows]
    groups, tokens = group_index[rows].tolist(), row_tokens[rows].tolist()
    ids = sorted(set(groups))
    per_group = dict.fromkeys(ids, 0)
    for g, t in zip(groups, tokens, strict=True):
        per_group[g] += int(t)
    out = []
    for picked in assign_groups([per_group[g] for g in ids], world_size):
        mine = {ids[i] for i in picked}
        out.append(rows[[i for i, g in enumerate(groups) if g in mine]])
    return out
