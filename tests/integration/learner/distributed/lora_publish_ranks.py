"""Run by torchrun from test_gathered_weights.py: a tiny model with a LoRA adapter, sharded over the ranks
(FSDP2, gloo; a rank-3 adapter's A factors shard unevenly over 2 ranks), publishes through a real
`Persistence` with `lora` set: every rank passes the whole state's names, and the adapter's alone are
gathered, streamed into rank 0's adapter folder. Rank 0 writes what it found.
Arguments: MODEL_DIR WEIGHTS_DIR OUT_JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.lora import LoraConfig
from offpolicy.learner.distributed.fsdp import shard
from offpolicy.learner.distributed.ranks import init_from_env, leave
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import load_model, lora
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.precision import Precision
from offpolicy.learner.persist.durable_writes import Persistence

LORA = LoraConfig(rank=3, alpha=6.0, target_modules=["q_proj", "v_proj", "up_proj"])


def main(model_dir: str, weights_dir: str, out: str) -> None:
    ranks = init_from_env("cpu")
    model = lora.inject(load_model(model_dir, "cpu", torch.float32), LORA, seed=7)
    g = torch.Generator().manual_seed(11)  # the same on every rank: B off zero, as after some steps
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(torch.randn(p.shape, generator=g))
    want = {
        lora.published_name(n): t.detach().to(torch.bfloat16).clone()
        for n, t in model.state_dict().items()
        if lora.is_adapter_name(n)
    }
    keys = set(unique_state(model))  # the whole state: the adapter's are picked out
    shard(
        LogProbs(model), model.config.num_hidden_layers, Precision.resolve("fp32", torch.device("cpu")), False
    )
    config = LearnerConfig.model_validate(
        {"model_path": model_dir, "lora": LORA.model_dump(), "publish": {"weights_dir": weights_dir}}
    )
    persist = Persistence(
        config, model, None, torch.bfloat16, None, LearnerMetrics(CollectorRegistry()), ranks=ranks
    )
    persist.publish(1, keys)
    persist.fence()
    persist.flush()
    persist.close()
    if ranks.is_leader:
        from safetensors.torch import load_file

        folder = Path(weights_dir) / "v1"
        got = load_file(folder / "adapter_model.safetensors")
        result = {
            "files": sorted(p.name for p in folder.iterdir()),
            "names_match": sorted(got) == sorted(want),
            "dtypes": sorted({str(t.dtype) for t in got.values()}),
            "max_abs_diff": max(float((got[k].float() - want[k].float()).abs().max()) for k in want),
            "config": json.loads((folder / "adapter_config.json").read_text()),
        }
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


if __name__ == "__main__":
    main(*sys.argv[1:4])
