"""Run by torchrun from test_gathered_weights.py: a tiny model sharded over the ranks (FSDP2, gloo) publishes
versions 1-6 through a real `Persistence` with `publish.delta: on` (`full_every` 4) and the files
transport: each version's gather streams into rank 0's writer in small buckets, which writes it whole or
as a delta. Rank 0 builds each version as an actor does (actors/transport/delta_chain.py) and writes, per
version, its base (null: whole) and whether the built folder is bit-equal to the full weights in bf16.
Arguments: MODEL_DIR WEIGHTS_DIR OUT_JSON."""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.persist import durable_writes
from tests.integration.learner.distributed.stream_ranks import full_weights, sharded


def main(model_dir: str, weights_dir: str, out: str) -> None:
    ranks, model, keys = sharded(model_dir)
    config = LearnerConfig.model_validate({
        "model_path": model_dir,
        "publish": {"weights_dir": weights_dir, "gather_bucket_mb": 1, "delta": "on", "full_every": 4},
    })  # fmt: skip
    persist = durable_writes.Persistence(
        config, model, None, torch.bfloat16, None, LearnerMetrics(CollectorRegistry()), ranks=ranks
    )
    rows = []
    chain = None
    if ranks.is_leader:
        from offpolicy.actors.transport.delta_chain import DeltaChain

        chain = DeltaChain(tempfile.mkdtemp())
    for version in range(1, 7):
        with torch.no_grad():  # a few values of every tensor change, as an optimizer step moves them
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.view(-1)[:: 5 + version].mul_(1.05)
        persist.publish(version, keys)
        persist.fence()
        want = full_weights(model, keys)
        persist.flush()
        if ranks.is_leader:
            from offpolicy.learner.persist.version_folders import version_dir
            from offpolicy.weights.delta import manifest_base
            from offpolicy.weights.manifest import read_manifest

            folder = version_dir(weights_dir, version)
            base = manifest_base(folder)
            built = (
                folder
                if base is None
                else chain.build(folder, read_manifest(folder)["sha256"], version).folder
            )
            got: dict[str, torch.Tensor] = {}
            for f in built.glob("*.safetensors"):
                got |= load_file(f)
            equal = sorted(got) == sorted(want) and all(
                torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want
            )
            rows.append({"version": version, "base": base, "bit_equal": equal})
    holders = torch.tensor([int(persist.deltas is not None)])
    dist.all_reduce(holders)  # the ranks that keep a base: rank 0 alone
    persist.close()
    if ranks.is_leader:
        result = {
            "versions": rows,
            "delta_base_bytes": persist.deltas.base_bytes,
            "holders": int(holders),
            "delta_share_gauge": persist.metrics.publish_delta_share._value.get(),  # v6's, a delta
        }
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:4])
