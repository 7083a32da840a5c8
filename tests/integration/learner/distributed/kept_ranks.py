"""Run by torchrun from test_gathered_weights.py: `publish.transport: vllm` (a broadcast backend) on 2 ranks
(FSDP2, gloo), through a real `Persistence` and `Publisher` (a recording transport on rank 0 stands in for
vLLM's), `persist_every: 3`. Rank 1's part of v1's gather is held back: v1's publish returns on both ranks
with the gather under way and nothing sent; v2 and v3 wait behind it, v3 replacing v2. Once released, rank 0
sends v1 at a step boundary (`poll`); v4 replaces v3 and is sent at `flush`; v5 (not due as files) is
written all the same because a checkpoint asks for it. Rank 0 writes what it saw: the versions sent and
written and how each compares with the weights of its step. Arguments: MODEL_DIR WEIGHTS_DIR OUT_JSON."""

from __future__ import annotations

import json
import sys
import threading
import time

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import load_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.persist import durable_writes
from offpolicy.learner.persist.background_gather import BackgroundGather
from offpolicy.learner.transport.base import TransferResult
from offpolicy.learner.transport.publisher import Publisher
from tests.integration.learner.distributed.stream_ranks import full_weights, sharded


def main(model_dir: str, weights_dir: str, out: str) -> None:
    ranks, model, keys = sharded(model_dir)
    leader = ranks.is_leader
    config = LearnerConfig.model_validate({
        "model_path": model_dir,
        "publish": {
            "transport": "vllm", "persist_every": 3, "gather_bucket_mb": 1, "weights_dir": weights_dir,
            "keep_versions": 5,
        },
    })  # fmt: skip
    gate = threading.Event()
    if not leader:  # rank 1's part of the next gather waits for the gate (a slow rank)
        run = BackgroundGather._run

        def held(self) -> None:
            gate.wait(60)
            run(self)

        BackgroundGather._run = held
    metrics = LearnerMetrics(CollectorRegistry())
    persist = durable_writes.Persistence(config, model, None, torch.bfloat16, None, metrics, ranks=ranks)
    publisher = Publisher(config, persist, None, None, gather=(model, torch.bfloat16, 2**20, leader))
    persist.gathers.keep = True
    sent: list[tuple[int, dict]] = []

    class Recording:
        def send(self, version: int) -> TransferResult:
            sent.append((version, {k: v.clone() for k, v in publisher.gathered().items()}))
            return TransferResult(version, 0.0, ok=True)

        def close(self) -> None:
            pass

    if leader:
        publisher.transport = Recording()
        persist.gathers.send = publisher.send_gathered
    want, publish_s, under_way = {}, [], []

    def publish(version: int) -> None:
        with torch.no_grad():  # the model changes between publishes, as optimizer steps change it
            for p in model.parameters():
                p.add_(0.25)
        want[version] = full_weights(model, keys)
        t0 = time.perf_counter()
        publisher.publish(version, keys)
        persist.fence()  # the step's part: the shards' snapshot
        publish_s.append(time.perf_counter() - t0)
        under_way.append(persist.gathers.gathering.copy.reads())

    for version in (1, 2, 3):
        publish(version)
    held_sent = [v for v, _ in sent]
    gate.set()
    if leader:
        deadline = time.monotonic() + 60
        while not sent:  # the step boundaries after v1's gather completes
            assert time.monotonic() < deadline, "v1 was never sent"
            persist.poll()
            time.sleep(0.01)
    publish(4)
    persist.flush()
    publish(5)
    publisher.at_checkpoint(5, keys)  # a checkpoint's version is written as files
    persist.flush()
    coalesced = metrics.writes_coalesced._value.get()
    persist.close()
    if leader:
        from offpolicy.learner.persist.version_folders import published_versions, version_dir

        written = {}
        for v in published_versions(weights_dir):
            state = unique_state(load_model(version_dir(weights_dir, v), "cpu", torch.bfloat16))
            written[v] = diff(state, want[v])
        result = {
            "sent": [v for v, _ in sent],
            "sent_max_abs_diff": {v: diff(t, want[v]) for v, t in sent},
            "sent_names_match": all(sorted(t) == sorted(want[v]) for v, t in sent),
            "written_max_abs_diff": written,
            "sent_while_held": held_sent,
            "under_way_after_publish": under_way[:3],
            "publish_s_while_held": publish_s[:3],
            "coalesced": coalesced,
            "left_in_publisher": len(publisher.gathered()),
        }
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


def diff(got: dict, want: dict) -> float:
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


if __name__ == "__main__":
    main(*sys.argv[1:4])
