"""Run by torchrun from tests/integration/weights/test_gathered_transfer.py: a learner's weights on 2 ranks
(FSDP2, gloo) published through the learner's own publish path (`make_publisher`, `publish.transport: vllm`,
`transfer.backend: gloo`: rank 0 broadcasts) into a real vLLM engine. Every version is gathered to rank 0 in
the background; rank 0 sends it at a later step boundary (`poll`). v1 and v3 are due as files
(`persist_every: 2`), v2 is sent only. Then rank 0 writes `OUT_PREFIX.json` (what each send returned, the
versions written) and `OUT_PREFIX.sent`, and waits for `OUT_PREFIX.done`. Arguments: MODEL_DIR REDIS_URL
RUN_ID WEIGHTS_DIR OUT_PREFIX."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import load_tokenizer
from offpolicy.learner.persist.durable_writes import Persistence
from offpolicy.learner.persist.version_folders import published_versions
from offpolicy.learner.transport.publisher import make_publisher
from offpolicy.weights.control import LearnerControl
from tests.integration.learner.distributed.stream_ranks import sharded


def main(model_dir: str, redis_url: str, run_id: str, weights: str, out: str) -> None:
    ranks, model, keys = sharded(model_dir)
    config = LearnerConfig.model_validate({
        "model_path": model_dir, "redis_url": redis_url, "run_id": run_id,
        "publish": {
            "transport": "vllm", "persist_every": 2, "weights_dir": weights, "gather_bucket_mb": 1,
            "transfer": {"backend": "gloo", "timeout_s": 20.0, "heartbeat_s": 2.0, "bucket_bytes": 1 << 20},
        },
    })  # fmt: skip
    registry = CollectorRegistry()
    persist = Persistence(
        config, model, load_tokenizer(model_dir), torch.float32, None, LearnerMetrics(registry), ranks=ranks
    )
    publisher = make_publisher(config, persist, model, torch.float32, registry, ranks)
    if ranks.is_leader:  # the actor has announced itself before the first send
        control = LearnerControl(redis_url, run_id)
        wait(lambda: control.members(), "no actor announced itself")
    dist.barrier()
    results = []
    for version in (1, 2, 3):
        with torch.no_grad():  # the weights change between publishes, as optimizer steps change them
            for p in model.parameters():
                p.mul_(1.01)
        publisher.publish(version, keys)
        persist.fence()
        if ranks.is_leader:  # the step boundaries after its gather completed: it is sent
            wait(lambda v=version: sent(publisher, v, persist), f"v{version} was never sent")
            last = publisher.last
            results.append({"version": last.version, "ok": last.ok, "group_size": last.group_size})
        dist.barrier()
    persist.flush()
    if ranks.is_leader:
        written = published_versions(weights)
        Path(f"{out}.json").write_text(json.dumps({"results": results, "written": written}))
        Path(f"{out}.sent").touch()
        wait(lambda: Path(f"{out}.done").exists(), "the test never finished with the actor")
    dist.barrier()
    persist.close()
    publisher.close()
    leave()


def sent(publisher, version: int, persist) -> bool:
    persist.poll()
    return publisher.last is not None and publisher.last.version == version


def wait(ready, why: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


if __name__ == "__main__":
    main(*sys.argv[1:6])
