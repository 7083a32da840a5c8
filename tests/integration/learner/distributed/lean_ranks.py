"""Run by torchrun from test_lean_start.py: the lean start's two ways on 2 ranks (FSDP2, gloo): each rank
reads its own slices of the safetensors files (`load_shards`), or rank 0 alone holds the full state dict
and broadcasts (`broadcast_from_rank0`); both against the model loaded whole. A checkpoint that does not
map one to one (a tensor renamed) is refused by `load_shards` on every rank. Arguments: MODEL_DIR
RENAMED_DIR OUT_JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from offpolicy.learner.distributed.fsdp import shard
from offpolicy.learner.distributed.lean import broadcast_from_rank0, load_shards, materialize, meta_model
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.model import load_model
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision


def sharded(model_dir: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = meta_model(model_dir, torch.float32)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated yet
    root = LogProbs(model)
    shard(root, model.config.num_hidden_layers, Precision.resolve("fp32", torch.device("cpu")), False)
    with torch.no_grad():
        materialize(root, torch.device("cpu"))
    return root, model


def compare(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> float:
    diff = 0.0
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        diff = max(diff, float((full - want[name]).abs().max()))
    return diff


def main(model_dir: str, renamed_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    leader = dist.get_rank() == 0
    want = load_model(model_dir, "cpu", torch.float32).state_dict()
    _, by_slices = sharded(model_dir)
    took_slices = load_shards(by_slices, model_dir)
    slices_diff = compare(by_slices, want)
    root, by_broadcast = sharded(model_dir)
    broadcast_from_rank0(root, "lm", want if leader else None)
    broadcast_diff = compare(by_broadcast, want)
    _, other = sharded(model_dir)
    refused = not load_shards(other, renamed_dir)
    result = {
        "rank": dist.get_rank(),
        "took_slices": took_slices,
        "slices_diff": slices_diff,
        "broadcast_diff": broadcast_diff,
        "refused_renamed": refused,
    }
    with open(f"{out}.{dist.get_rank()}", "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


if __name__ == "__main__":
    main(*sys.argv[1:])
