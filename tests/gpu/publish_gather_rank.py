"""Run by test_publish_gather_cuda.py as one NCCL rank on GPU 0: shard a tiny model (FSDP2), snapshot it for a
background gather (`BackgroundGather`, persist/background_gather.py), queue ~2 s of work on the training's
stream (`torch.cuda._sleep`), then run the gather and time it; write whether it finished while that stream
was still busy and whether rank 0 got the weights. Arguments: MODEL_DIR OUT_JSON."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from offpolicy.learner.distributed.fsdp import shard
from offpolicy.learner.model import load_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision
from offpolicy.learner.persist.background_gather import (
    PUBLISH_BACKEND,
    BackgroundGather,
    close_publish_groups,
)

SLEEP_CYCLES = 4_000_000_000  # ~2 s of one SM's clock: the training stream stays busy while the gather runs


def main(model_dir: str, out: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    model = load_model(model_dir, device, torch.float32)
    want = {k: v.detach().to(torch.bfloat16).cpu() for k, v in unique_state(model).items()}
    shard(LogProbs(model), model.config.num_hidden_layers, Precision.resolve("fp32", device), False)
    gather = BackgroundGather(model, set(want), torch.bfloat16, leader=True, bucket_bytes=2**20)
    gather.released()  # the shards' host snapshot is complete
    torch.cuda._sleep(SLEEP_CYCLES)  # the training stream's queued work
    t0 = time.monotonic()
    gather.start()
    got = gather.wait()
    gather_s = time.monotonic() - t0
    stream_busy = not torch.cuda.current_stream().query()  # the queued work still runs
    t1 = time.monotonic()
    torch.cuda.synchronize()
    result = {
        "backend": dist.get_backend(),
        "publish_backend": PUBLISH_BACKEND,
        "gather_s": gather_s,
        "stream_busy_after_gather": stream_busy,
        "queued_work_left_s": time.monotonic() - t1,
        "buckets": gather.buckets,
        "names_match": sorted(got) == sorted(want),
        "max_abs_diff": max(float((got[k].float() - want[k].float()).abs().max()) for k in want),
    }
    close_publish_groups()
    dist.destroy_process_group()
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(*sys.argv[1:3])
