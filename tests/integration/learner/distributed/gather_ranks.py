"""Run by torchrun from test_gathered_weights.py: shard a tiny model over the ranks (FSDP2, gloo) and
gather its full weights to rank 0's host memory in `dtype`; rank 0 writes how they compare with the
unsharded model's weights cast the same way. Arguments: MODEL_DIR DTYPE OUT_JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from offpolicy.learner.distributed.fsdp import shard
from offpolicy.learner.distributed.gather import GatheredWeights
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.model import load_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision


def main(model_dir: str, dtype_name: str, out: str) -> None:
    dist.init_process_group("gloo")
    dtype = getattr(torch, dtype_name)
    model = load_model(model_dir, "cpu", torch.float32)
    keys = set(unique_state(model))
    shard(
        LogProbs(model), model.config.num_hidden_layers, Precision.resolve("fp32", torch.device("cpu")), False
    )
    leader = dist.get_rank() == 0
    first = GatheredWeights(model, keys, dtype, leader).wait()
    again = GatheredWeights(model, keys, dtype, leader, into=first).wait()  # reuses the buffers
    small = GatheredWeights(model, keys, dtype, leader, bucket_bytes=8192)  # many buckets of <= 8 KiB
    whole = GatheredWeights(model, keys, dtype, leader)  # the default bucket: the tiny model in one
    if leader:
        want = {
            k: v.to(dtype) if v.is_floating_point() else v
            for k, v in unique_state(load_model(model_dir, "cpu", torch.float32)).items()
        }
        result = {
            "names_match": sorted(first) == sorted(want),
            "max_abs_diff": max(float((first[k].float() - want[k].float()).abs().max()) for k in want),
            "dtypes": sorted({str(t.dtype) for t in first.values()}),
            "buffers_reused": all(again[k] is first[k] for k in first),
            "shapes_match": all(first[k].shape == want[k].shape for k in want),
            "small_buckets_diff": max(
                float((small.tensors[k].float() - want[k].float()).abs().max()) for k in want
            ),
            "small_buckets": small.buckets,
            "small_max_bucket_bytes": small.max_bucket_bytes,
            "largest_tensor_bytes": max(v.numel() * v.element_size() for v in want.values()),
            "largest_row_bytes": max(v[0].numel() * v.element_size() for v in want.values() if v.dim()),
            "one_bucket": whole.buckets,
        }
        with open(out, "w") as fh:
            json.dump(result, fh)
    else:
        assert not small.tensors and not first  # rank 1 holds nothing
    dist.barrier()  # rank 1 must not tear gloo down while rank 0 still compares (it aborted under load)
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


if __name__ == "__main__":
    main(*sys.argv[1:4])
