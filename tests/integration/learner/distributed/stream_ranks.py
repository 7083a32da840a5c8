"""Run by torchrun from test_gathered_weights.py: a tiny model sharded over the ranks (FSDP2, gloo) publishes
through a real `Persistence` with the files transport, its gather streamed into rank 0's writer in small
buckets, while rank 0's writer is held back (a slow disk): v1's gather stops when the writer's queue is
full; v2 and v3 are published meanwhile (v2 is replaced by v3 before it starts: coalesced on every rank);
`flush` writes v3. Rank 0 writes what it saw. Arguments: MODEL_DIR WEIGHTS_DIR OUT_JSON."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.publish import STREAM_DEPTH
from offpolicy.learner.distributed.fsdp import shard
from offpolicy.learner.distributed.gather import full_tensor
from offpolicy.learner.distributed.ranks import init_from_env, leave
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import load_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision
from offpolicy.learner.persist import durable_writes

BUCKET_MB = 1  # the test's model is many buckets of 1 MiB


def sharded(model_dir: str):
    """(ranks, the model sharded over them with FSDP2 in fp32, the names to publish)."""
    ranks = init_from_env("cpu")
    model = load_model(model_dir, "cpu", torch.float32)
    keys = set(unique_state(model))
    shard(
        LogProbs(model), model.config.num_hidden_layers, Precision.resolve("fp32", torch.device("cpu")), False
    )
    return ranks, model, keys


def main(model_dir: str, weights_dir: str, out: str) -> None:
    ranks, model, keys = sharded(model_dir)
    config = LearnerConfig.model_validate(
        {"model_path": model_dir, "publish": {"weights_dir": weights_dir, "gather_bucket_mb": BUCKET_MB}}
    )
    gate, entered = threading.Event(), threading.Event()
    real = durable_writes.publish_snapshot

    def slow_disk(snap, *args, **kwargs):  # the writer waits for the gate before it reads the stream
        entered.set()
        gate.wait()
        return real(snap, *args, **kwargs)

    durable_writes.publish_snapshot = slow_disk
    persist = durable_writes.Persistence(
        config, model, None, torch.bfloat16, None, LearnerMetrics(CollectorRegistry()), ranks=ranks
    )
    want = {}
    persist.publish(1, keys)
    persist.fence()  # the step's part: the shards' snapshot
    want[1] = full_weights(model, keys)
    if ranks.is_leader:
        assert entered.wait(30), "the writer never started"
        gathering = persist.gathers.gathering.copy
        deadline = time.monotonic() + 60
        while not (gathering._queue.full() and waits_in_put(gathering._thread)):  # it cannot go on
            assert time.monotonic() < deadline, f"the gather never blocked ({gathering.buckets} buckets)"
            time.sleep(0.01)
        held = gathering.buckets  # buckets gathered while the writer has read none
    for version in (2, 3):  # the model changes between publishes, as optimizer steps change it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
        persist.publish(version, keys)
        persist.fence()
        want[version] = full_weights(model, keys)
    coalesced = persist.metrics.writes_coalesced._value.get()
    gate.set()
    persist.flush()
    persist.close()
    if ranks.is_leader:
        from offpolicy.learner.persist.version_folders import published_versions, version_dir

        got = {}
        for v in published_versions(weights_dir):
            state = unique_state(load_model(version_dir(weights_dir, v), "cpu", torch.bfloat16))
            got[v] = max(float((state[k].float() - want[v][k].float()).abs().max()) for k in want[v])
        result = {
            "versions": published_versions(weights_dir),
            "max_abs_diff": got,
            "buckets_held": held,
            "stream_depth": STREAM_DEPTH,
            "buckets_total": persist.gathers.gathering.copy.buckets,
            "coalesced": coalesced,
            "kept": len(persist.gathers.gathering.copy.tensors),
        }
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


def waits_in_put(thread: threading.Thread) -> bool:
    """`thread` is inside `queue.Queue.put` (with the queue full: blocked until a reader takes one)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is queue.Queue.put.__code__:
            return True
        frame = frame.f_back
    return False


def full_weights(model, keys) -> dict[str, torch.Tensor]:
    """The model's full weights now, in bf16 (a collective)."""
    return {
        k: full_tensor(v.detach(), torch.bfloat16 if v.is_floating_point() else v.dtype)
        for k, v in model.state_dict().items()
        if k in keys
    }


if __name__ == "__main__":
    main(*sys.argv[1:4])
