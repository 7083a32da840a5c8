"""Which rows each pass of a learner step runs: mini-batches, micro-batches, each rank's share.

A mini-batch is whole groups (one optimizer step); its rows are split among the ranks (whole groups,
balanced by tokens: distributed/split.py) and each rank's share into micro-batches (one forward and
backward pass each). On N ranks FSDP pairs every rank's k-th pass layer by layer, so every rank must run as
many passes, in the same order: a rank with fewer rows pads its list with idle passes (`None`, run on
`idle_rows`), which contribute nothing. `rows_forward` runs a no-grad forward (pi_old, the critic's values)
over the whole batch that way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from learner.batch import Batch
from learner.config import LearnerConfig
from learner.distributed.ranks import SINGLE, Ranks, all_reduce_sum
from learner.distributed.split import shares
from learner.model.precision import Precision


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Split a (n,) row index into chunks of at most `size` (none for no rows: `torch.split` would give
    one empty chunk, a pass over zero rows)."""
    return list(torch.split(rows, size)) if rows.numel() else []


def mini_batches(
    batch: Batch, groups_per_mini_batch: int | None, generator: torch.Generator
) -> list[torch.Tensor]:
    """Row indices of each mini-batch: groups shuffled by `generator` (every rank draws the same order),
    `groups_per_mini_batch` at a time (None = all)."""
    n_groups = int(batch.group_index.max()) + 1
    per = groups_per_mini_batch or n_groups
    order = torch.randperm(n_groups, generator=generator).to(batch.group_index.device)
    return [
        torch.isin(batch.group_index, order[i : i + per]).nonzero().squeeze(-1)
        for i in range(0, n_groups, per)
    ]


def rank_micro_batches(
    batch: Batch, rows: torch.Tensor, size: int, ranks: Ranks
) -> list[torch.Tensor | None]:
    """This rank's micro-batches of the global rows `rows` (its share: whole groups, balanced by tokens),
    padded with `None` to the micro-batch count of the busiest rank: every rank runs as many forward and
    backward passes (FSDP's collectives pair up), a `None` being a pass that contributes nothing."""
    parts = shares(rows, batch.group_index, batch.attention_mask.sum(-1), ranks.world_size)
    count = max(math.ceil(len(p) / size) for p in parts)
    mine: list[torch.Tensor | None] = list(micro_batches(parts[ranks.rank], size))
    return mine + [None] * (count - len(mine))


def idle_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """A pass that contributes nothing: the first row of `rows`, every mask cleared."""
    mb = batch.select(rows[:1])
    return dataclasses.replace(mb, response_mask=mb.response_mask * 0, sampled_mask=mb.sampled_mask * 0)


@torch.no_grad()
def rows_forward(
    fn: Callable[[Batch], torch.Tensor], batch: Batch, size: int, ranks: Ranks = SINGLE
) -> torch.Tensor:
    """`fn` (a (b, r) result per micro-batch: log-probs, values) over the whole batch, (B, R): each rank
    runs its share, the results are summed across ranks (exact: the other rows are zeros)."""
    width = batch.response_ids.shape[1]
    rows = torch.arange(batch.num_rows, device=batch.response_ids.device)
    out = torch.zeros(batch.num_rows, width, device=rows.device)
    for mb_rows in rank_micro_batches(batch, rows, size, ranks):
        if mb_rows is None:
            fn(idle_rows(batch, rows))  # the other ranks' collectives need this pass
            continue
        part = fn(batch.select(mb_rows))
        out[mb_rows, : part.shape[1]] = part
    return all_reduce_sum(ranks, out)


def no_grad_logprobs(
    policy: torch.nn.Module, batch: Batch, cfg: LearnerConfig, precision: Precision, ranks: Ranks = SINGLE
) -> torch.Tensor:
    """pi_old: log-probs of the whole batch under the current weights, micro-batched, (B, R)."""
    with precision.autocast():
        return rows_forward(
            lambda mb: policy(mb, cfg.logprob_chunk_tokens), batch, cfg.micro_batch_size, ranks
        )
