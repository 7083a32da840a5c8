"""Run by torchrun from tests/integration/weights/test_sharded_transfer.py: a learner's weights on 2 ranks
(FSDP2, gloo), perturbed alike on every rank (rank 0 first writes them as the file generation of v1), sent
to the actors by `ShardedTransport` (`gloo_m2n`): every rank sends its own shards, nothing is gathered. v1
forms the group, v2 (the same weights) reuses it. Then rank 0 writes `OUT_PREFIX.sent`, waits for
`OUT_PREFIX.killed` (the test killed the actor's engine) and every rank sends v3 (it must fail on both
ranks, within the bound); once the actor's membership lapsed, v4 finds no one (both ranks, at once). Each
rank writes what its sends returned and the bytes it sent. Arguments: MODEL_DIR REDIS_URL RUN_ID WEIGHTS_DIR
OUT_PREFIX."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from offpolicy.learner.distributed.fsdp import shard
from offpolicy.learner.distributed.ranks import Ranks, leave
from offpolicy.learner.model import load_model, load_tokenizer
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.learner.transport.m2n import ShardedTransport, _state
from offpolicy.weights.config import TransferConfig
from offpolicy.weights.control import LearnerControl

CFG = TransferConfig(backend="gloo_m2n", timeout_s=15.0, heartbeat_s=0.5, bucket_bytes=1 << 20)


def main(model_dir: str, redis_url: str, run_id: str, weights: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ranks = Ranks(rank=rank, world_size=dist.get_world_size(), local_rank=rank, control=dist.group.WORLD)
    model = load_model(model_dir, "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in unique_state(model).values():
            if t.is_floating_point():
                t.add_(0.05 * torch.randn(t.shape, generator=g))
    if rank == 0:
        publish_weights(model, weights, 1, tokenizer=load_tokenizer(model_dir), dtype=torch.float32)
    shard(
        LogProbs(model), model.config.num_hidden_layers, Precision.resolve("fp32", torch.device("cpu")), False
    )
    control = LearnerControl(redis_url, run_id) if rank == 0 else None
    _wait_for(control, lambda: control.members(), "no actor announced itself")
    transport = ShardedTransport(CFG, control, model, torch.float32, ranks)
    results = []

    def send(version: int) -> None:
        r = transport.send(version)
        keys = ("version", "ok", "error", "group_size", "bytes", "seconds")
        own = getattr(transport.engine, "bytes_sent", 0) if r.ok else 0  # this rank's share
        results.append({k: getattr(r, k) for k in keys} | {"epoch": transport.epoch, "own_bytes": own})

    send(1)
    send(2)
    if rank == 0:
        Path(f"{out}.sent").touch()
    _wait_for(control, lambda: Path(f"{out}.killed").exists(), "the test did not kill the actor")
    send(3)
    _wait_for(control, lambda: not control.members(), "the killed actor's membership did not lapse")
    send(4)
    local = sum(t.to_local().numel() * 4 for t in _state(model).values() if hasattr(t, "to_local"))
    with open(f"{out}{rank}.json", "w") as fh:
        json.dump(
            {
                "results": results,
                "trainer_rank": transport.trainer_rank,
                "trainers": transport.trainers,
                "local_shard_bytes": local,
                "nccl_m2n": vllm_m2n_source(model, rank),
            },
            fh,
        )
    transport.close()
    dist.barrier()
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


def vllm_m2n_source(model: torch.nn.Module, rank: int) -> dict:
    """What `nccl_m2n` would read (vLLM's M2N source classes over this rank's shards, bfloat16) and that
    its trainer init info is accepted; the NCCL engine itself needs GPUs."""
    from offpolicy.learner.transport.m2n import _trainer_init_info, _vllm_m2n_source

    source = _vllm_m2n_source(model, torch.bfloat16, 2)
    metas = source.metadata()
    pairs = list(source)
    info = _trainer_init_info(TransferConfig(backend="nccl_m2n", port=29999), 29999, 3, 2, rank)
    return {
        "mesh_dims": list(source.mesh().dims),
        "names_match": [m.name for m in metas] == [n for n, _ in pairs] == list(_state(model)),
        "placements": sorted({str(m.placements) for m in metas}),
        "dtypes": sorted({str(t.dtype) for _, t in pairs}),
        "local_bytes": sum(t.numel() * t.element_size() for _, t in pairs),
        "init": [info.rank, info.num_trainer_ranks, info.world_size],
    }


def _wait_for(control, cond, message: str) -> None:
    """Rank 0 waits for `cond` (the others wait in the next collective)."""
    deadline = time.monotonic() + 120
    while control is not None and not cond():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


if __name__ == "__main__":
    main(*sys.argv[1:6])
