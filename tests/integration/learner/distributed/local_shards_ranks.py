"""Run by torchrun from tests/integration/weights/test_sharded_transfer.py: what `LocalShards` (gloo_m2n's
source) gives each of 2 ranks, flat (FSDP2 over both) or hybrid (`fsdp.replicate` 2: each rank a replica
holding every shard): its plan, its place among the senders, and whether what it yields is exactly its rows of
the full weights in the publish dtype. Arguments: MODEL_DIR REPLICATE OUT_PREFIX."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from offpolicy.learner.distributed.fsdp import fsdp_mesh, shard
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.model import load_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision
from offpolicy.learner.transport.m2n import LocalShards
from offpolicy.weights.engines.gloo_m2n import part_bytes, rows


def main(model_dir: str, replicate: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = load_model(model_dir, "cpu", torch.float32)
    full = {k: v.detach().to(torch.bfloat16).clone() for k, v in unique_state(model).items()}
    mesh = fsdp_mesh(int(replicate), torch.device("cpu"))
    precision = Precision.resolve("fp32", torch.device("cpu"))
    shard(LogProbs(model), model.config.num_hidden_layers, precision, False, mesh)
    shards = LocalShards(model, torch.bfloat16, rank)
    plan = shards.plan()
    exact, sizes_match = True, True
    for (name, dtype, shape, placement), (got_name, t) in zip(plan, shards, strict=True):
        assert name == got_name
        sizes_match &= t.numel() * t.element_size() == (
            part_bytes(shape, dtype, placement, shards.trainers, shards.trainer_rank or 0)
            if shards.trainer_rank is not None
            else t.numel() * t.element_size()
        )
        if shards.trainer_rank is not None:
            start, stop = rows(shape[0], shards.trainers, shards.trainer_rank)
            want = full[name][start:stop] if placement == 0 else full[name]
            exact &= t.dtype == torch.bfloat16 and torch.equal(t, want)
    with open(f"{out}{rank}.json", "w") as fh:
        json.dump(
            {
                "trainers": shards.trainers,
                "trainer_rank": shards.trainer_rank,
                "names_match": [n for n, *_ in plan] == list(full),
                "placements": sorted({str(p) for *_, p in plan}),
                "exact": exact,
                "sizes_match": sizes_match,
            },
            fh,
        )
    dist.barrier()
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


if __name__ == "__main__":
    main(*sys.argv[1:4])
