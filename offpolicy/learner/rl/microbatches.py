"""Which rows each pass of a learner step runs: mini-batches, micro-batches, each rank's share.

A mini-batch is whole groups (one optimizer step); its rows become micro-batches (one forward and backward
pass each) in one of two ways:

- packed (`packing: true`, the default): `plan_micro_batches` bin-packs the mini-batch's sequences by
  token count (largest first onto the lightest bin) into `world_size * k` micro-batches of at most
  `micro_batch_tokens` tokens, k the fewest that fit; a sequence longer than the budget gets a bin of its
  own. The bins, heaviest first, are dealt out `world_size` at a time, so every rank runs k micro-batches
  and the k-th of every rank carry about the same tokens (FSDP's lock-step waits on the slowest);
- padded rows (`packing: false`): each rank's share of whole groups (distributed/split.py), `micro_batch_size`
  rows at a time.

On N ranks FSDP pairs every rank's k-th pass layer by layer, so every rank must run as many passes, in the
same order: a rank with fewer passes pads its list with idle passes (`None`, run on `idle_rows`), which
contribute nothing. `rows_forward` runs a no-grad forward (pi_old, the critic's values) over the whole
batch that way: in `torch.inference_mode` on one process (no version counters, no view tracking), under
`torch.no_grad` on N ranks. FSDP2 keeps each layer's all-gather buffers for the life of the model: the
first gathered in inference mode (pi_old runs before any training pass) are inference tensors, which the
training pass may not update ("Inplace update to inference tensor outside InferenceMode", seen on 2 gloo
ranks, torch 2.13).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence

import torch

from offpolicy.learner.batch import Batch
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.ranks import SINGLE, Ranks, all_reduce_sum
from offpolicy.learner.distributed.split import shares
from offpolicy.learner.model import lora
from offpolicy.learner.model.precision import Precision


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


def plan_micro_batches(lengths: Sequence[int], budget: int, world_size: int) -> list[list[list[int]]]:
    """Packed micro-batches of sequences of `lengths` tokens: `[rank][k]` = the positions (into `lengths`,
    ascending) of rank `rank`'s k-th micro-batch. Every rank gets the same number k of micro-batches (some
    possibly empty: an idle pass), k the fewest for which largest-first bin packing keeps every bin within
    `budget` tokens or holding a single (longer) sequence. Deterministic: every rank computes the same
    plan."""
    n = len(lengths)
    k = max(1, math.ceil(sum(lengths) / (budget * world_size)))
    while True:
        bins = _largest_first(lengths, world_size * k)
        if k * world_size >= n or all(load <= budget or len(b) == 1 for load, b in bins):
            break
        k += 1
    bins.sort(key=lambda lb: (-lb[0], lb[1][:1]))  # heaviest first: the k-th of each rank are alike
    return [[sorted(bins[j * world_size + r][1]) for j in range(k)] for r in range(world_size)]


def _largest_first(lengths: Sequence[int], count: int) -> list[tuple[int, list[int]]]:
    """`count` bins of (load, positions): each sequence, longest first, onto the lightest bin (ties: the
    lower bin; equal lengths: the lower position first)."""
    heap = [(0, i) for i in range(count)]
    members: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for pos in sorted(range(len(lengths)), key=lambda p: (-lengths[p], p)):
        load, i = heapq.heappop(heap)
        members[i].append(pos)
        loads[i] = load + int(lengths[pos])
        heapq.heappush(heap, (loads[i], i))
    return [(loads[i], members[i]) for i in range(count)]


def rank_micro_batches(
    batch: Batch, rows: torch.Tensor, cfg: LearnerConfig, ranks: Ranks, budget: int | None = None
) -> list[torch.Tensor | None]:
    """This rank's micro-batches of the global rows `rows`, padded with `None` to the micro-batch count of
    the busiest rank: every rank runs as many forward and backward passes (FSDP's collectives pair up), a
    `None` being a pass that contributes nothing. Packed: `plan_micro_batches` by `budget` tokens (None =
    `micro_batch_tokens`); padded: its share of whole groups (balanced by tokens), `micro_batch_size`
    rows at a time."""
    if cfg.packing:
        lengths = batch.attention_mask[rows].sum(-1).tolist()  # (n,) tokens of each sequence
        tokens = budget or cfg.micro_batch_tokens
        assert isinstance(tokens, int), "the trainer resolves `auto` (memory_plan.Settings.apply)"
        plan = plan_micro_batches(lengths, tokens, ranks.world_size)[ranks.rank]
        return [rows[torch.tensor(mb, device=rows.device)] if mb else None for mb in plan]
    size = cfg.micro_batch_size
    parts = shares(rows, batch.group_index, batch.attention_mask.sum(-1), ranks.world_size)
    count = max(math.ceil(len(p) / size) for p in parts)
    mine: list[torch.Tensor | None] = list(micro_batches(parts[ranks.rank], size))
    return mine + [None] * (count - len(mine))


def idle_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """A pass that contributes nothing: the first row of `rows`, every mask cleared."""
    mb = batch.select(rows[:1])
    return dataclasses.replace(mb, response_mask=mb.response_mask * 0, sampled_mask=mb.sampled_mask * 0)


def grad_off(ranks: Ranks) -> contextlib.AbstractContextManager:
    """The no-grad mode of `rows_forward` on `ranks` (module docstring): inference mode on one process."""
    return torch.no_grad() if ranks.distributed else torch.inference_mode()


def rows_forward(
    fn: Callable[[Batch], torch.Tensor],
    batch: Batch,
    cfg: LearnerConfig,
    ranks: Ranks = SINGLE,
    trailing: tuple[int, ...] = (),
) -> torch.Tensor:
    """`fn` (a (b, r) result per micro-batch: log-probs, values) over the whole batch, (B, R): each rank
    runs its share, the results are summed across ranks (exact: the other rows are zeros). Packed, its
    micro-batches hold `no_grad_micro_batch_tokens` (no activations are kept: larger than training's).
    `trailing`: the dims of each result after (b, r) (the result is then (B, R, *trailing))."""
    width = batch.response_ids.shape[1]
    rows = torch.arange(batch.num_rows, device=batch.response_ids.device)
    out = torch.zeros(batch.num_rows, width, *trailing, device=rows.device)  # a normal tensor: loss reads it
    budget = cfg.no_grad_micro_batch_tokens
    for mb_rows in rank_micro_batches(batch, rows, cfg, ranks, budget if isinstance(budget, int) else None):
        with grad_off(ranks):
            if mb_rows is None:
                fn(idle_rows(batch, rows))  # lock-step: the other ranks' collectives need this pass
                continue
            part = fn(batch.select(mb_rows))
        out[mb_rows, : part.shape[1]] = part
    with torch.no_grad():
        return all_reduce_sum(ranks, out)


def no_grad_logprobs(
    policy: torch.nn.Module, batch: Batch, cfg: LearnerConfig, precision: Precision, ranks: Ranks = SINGLE
) -> torch.Tensor:
    """pi_old (or the reference's log-probs): log-probs of the whole batch under `policy` (a `LogProbs`),
    micro-batched, (B, R). A LoRA adapter's dropout is off (`lora.dropout`: the training passes alone)."""
    with precision.autocast(), lora.dropout_off(policy):
        return rows_forward(
            lambda mb: policy(mb, cfg.logprob_chunk_tokens, cfg.packing)[0], batch, cfg, ranks
        )


def no_grad_logprobs_entropy(
    policy: torch.nn.Module, batch: Batch, cfg: LearnerConfig, precision: Precision, ranks: Ranks = SINGLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """`no_grad_logprobs` and, from the same pass, each token's entropy, both (B, R): pi_old's pass, as
    verl's `compute_log_prob(calculate_entropy=True)`, so the entropy is logged every step whatever
    `entropy_coeff` (the LM head's chunks compute it beside the log-probs)."""
    with precision.autocast(), lora.dropout_off(policy):
        both = rows_forward(
            lambda mb: torch.stack(policy(mb, cfg.logprob_chunk_tokens, cfg.packing, True), dim=-1),
            batch, cfg, ranks, trailing=(2,),
        )  # fmt: skip
    return both[..., 0], both[..., 1]
