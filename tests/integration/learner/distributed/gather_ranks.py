"""Run by torchrun from test_gathered_weights.py: shard a tiny model over the ranks (FSDP2, gloo) and
gather its full weights to rank 0's host memory in `dtype`; rank 0 writes how they compare with the
unsharded model's weights cast the same way; then publishes twice through a `Publisher` with
`publish.transport: vllm` (a recording transport on rank 0 stands in for vLLM's): every rank joins the
gather, rank 0 sends the full weights. Arguments: MODEL_DIR DTYPE OUT_JSON."""

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
    sent = publish_twice(model_dir, model, keys, dtype, leader)
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
            "sent_versions": [v for v, _ in sent],
            "sent_max_abs_diff": max(
                float((t[k].float() - want[k].float()).abs().max()) for _, t in sent for k in want
            ),
            "sent_names_match": all(sorted(t) == sorted(want) for _, t in sent),
        }
        with open(out, "w") as fh:
            json.dump(result, fh)
    else:
        assert not small.tensors and not first and not sent  # rank 1 holds nothing, sends nothing
    dist.barrier()  # rank 1 must not tear gloo down while rank 0 still compares (it aborted under load)
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


class FilesOnce:
    """Stands in for `Persistence`: counts the file generations asked for (a collective on every rank) and,
    as it does, gathers each one's weights in the background (`BackgroundGather`), which `gathered()`
    hands to the transport: a version written as files is gathered once."""

    def __init__(self, model, dtype, leader: bool) -> None:
        self.versions: list[int] = []
        self.model, self.dtype, self.leader = model, dtype, leader
        self._gathering = None

    def publish(self, version: int, gather: set[str] | None) -> None:
        from offpolicy.learner.persist.background_gather import BackgroundGather

        self.versions.append(version)
        self._gathering = BackgroundGather(self.model, gather, self.dtype, self.leader, bucket_bytes=2**20)
        self._gathering.start()

    def gathered(self) -> dict:
        return self._gathering.wait() if self._gathering is not None else {}


def publish_twice(model_dir: str, model, keys: set[str], dtype, leader: bool) -> list:
    """Two publishes through the N-rank vllm path; rank 0's transport records what it would send."""
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.transport.base import TransferResult
    from offpolicy.learner.transport.publisher import Publisher

    config = LearnerConfig.model_validate(
        {"model_path": model_dir, "publish": {"transport": "vllm", "persist_every": 5, "gather_bucket_mb": 1}}
    )
    files, sent = FilesOnce(model, dtype, leader), []
    publisher = Publisher(config, files, None, None, gather=(model, dtype, 2**20, leader))

    class Recording:
        def send(self, version: int) -> TransferResult:
            sent.append((version, {k: v.clone() for k, v in publisher.gathered().items()}))
            return TransferResult(version, 0.0, ok=True)

        def close(self) -> None:
            pass

    if leader:
        publisher.transport = Recording()
    for version in (1, 2):
        publisher.publish(version, keys)
    assert files.versions == [1], files.versions  # persist_every 5: the first publish only, on every rank
    assert publisher.gathered() == {}  # the host copy lived for one send
    from offpolicy.learner.persist.background_gather import close_publish_groups

    files.gathered()  # every rank's part of the background gather is done
    close_publish_groups()
    return sent


if __name__ == "__main__":
    main(*sys.argv[1:4])
