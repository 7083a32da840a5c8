"""Run by torchrun from tests/integration/learner/test_lora.py (2 ranks, FSDP2, gloo): a LoRA policy built on
the ranks, with the lean start (`fsdp.lean_start: true`: meta, shard, each rank reads its base slices under
their checkpoint names, or rank 0 broadcasts the whole base, and copies its rows of the seeded factors) and
without it, holds exactly the one-process build's tensors, whole (gathered) on every rank; two optimizer steps
on the same batch (mixed frozen and trainable parameters in each FSDP unit) move the adapter alone, as in one
process; the KL reference (the sharded policy with its adapter off) gives the base model's log-probs. Each
rank writes its numbers as JSON. Arguments: MODEL_DIR OUT (OUT.<rank> written)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from offpolicy.learner.batch import collate
from offpolicy.learner.build import build_reference, build_trainables
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.distributed import lean
from offpolicy.learner.distributed.ranks import leave
from offpolicy.learner.model import Precision, lora
from tests.unit.learner.rl.test_microbatches import ragged_groups

CPU = torch.device("cpu")
FP32 = Precision.resolve("fp32", CPU)


def steps(parts, batch, n: int, scale: float) -> None:
    """`n` optimizer steps on -sum(log-probs) of `batch` (every rank the same batch: `scale` undoes FSDP's
    average over the ranks, as the learner's `loss_scale` does for its shares)."""
    for _ in range(n):
        lp, _ = parts.policy(batch, 64, True)
        (-lp.sum() * scale).backward()
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main(model_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    batch = collate(ragged_groups(2, 2, seed=7), pad_token_id=0)
    result: dict[str, object] = {"rank": dist.get_rank()}
    read_slices = lean.load_shards
    for case in ("lean", "lean, broadcast", "eager"):
        cfg = LearnerConfig.model_validate({
            "model_path": model_dir, "device": "cpu", "seed": 5, "optimizer": {"lr": 1e-3},
            "lora": {"rank": 4, "modules_to_save": ["lm_head"]}, "kl_loss_coef": 0.1,
            "fsdp": {"lean_start": case != "eager"},
        })  # fmt: skip
        one, _, _ = build_trainables(cfg, CPU, FP32, sharded=False, checkpointing=False)
        # "lean, broadcast": the slice reader refuses (as for a checkpoint that does not map one to one),
        # so rank 0 reads the whole base and broadcasts it under the model's names
        lean.load_shards = (lambda *_a, **_k: False) if case == "lean, broadcast" else read_slices
        two, keys, way = build_trainables(cfg, CPU, FP32, sharded=True, checkpointing=False)
        want = one.model.state_dict()
        start = max(float((whole(t) - want[n]).abs().max()) for n, t in two.model.state_dict().items())
        trainable = {n for n, p in two.model.named_parameters() if p.requires_grad}
        in_adamw = sum(len(g["params"]) for g in two.optimizer.param_groups)
        base = one.policy(batch, 64, True)[0].detach()  # version 0: the base model
        steps(one, batch, 2, 1.0)
        steps(two, batch, 2, float(dist.get_world_size()))
        want = one.model.state_dict()
        after = {n: float((whole(t) - want[n]).abs().max()) for n, t in two.model.state_dict().items()}
        reference = build_reference(cfg, CPU, FP32, True, two.policy)
        assert reference is not None
        ref = reference(batch, 64, True)[0]
        policy = two.policy(batch, 64, True)[0].detach()
        result[case] = {
            "way": way,
            "publish_keys_are_the_adapter": keys == set(lora.adapter_names(one.model)),
            "trainable_is_the_adapter": trainable == set(lora.adapter_names(one.model)),
            "adamw_params": in_adamw,
            "adapter_params": len(trainable),
            "start_diff": start,
            "trained_diff": max(after.values()),
            "top": sorted(after.items(), key=lambda kv: -kv[1])[:4],
            "ref_vs_base": float((ref - base).abs().max()),
            "policy_vs_base": float((policy - base).abs().max()),
            "adapter_moved": max(
                float((whole(p.detach()) - lora.initial_factor(n, p.shape, 5)).abs().max())
                for n, p in two.model.named_parameters()
                if lora.is_factor(n)
            ),
        }
    # bf16_mixed (the CUDA default), lean: the frozen base's shards in bf16 (no masters) beside the adapter's
    # fp32 masters in the same FSDP units; two steps train the adapter alone, the base stays as read
    mixed = Precision.resolve("bf16_mixed", CPU)
    cfg = LearnerConfig.model_validate({
        "model_path": model_dir, "device": "cpu", "seed": 5, "optimizer": {"lr": 1e-3},
        "precision": "bf16_mixed", "lora": {"rank": 4},
    })  # fmt: skip
    two, _, _ = build_trainables(cfg, CPU, mixed, sharded=True, checkpointing=False)
    base_before = {
        n: whole(p.detach()).clone() for n, p in two.model.named_parameters() if not p.requires_grad
    }
    with mixed.autocast():
        steps(two, batch, 2, float(dist.get_world_size()))
    params = dict(two.model.named_parameters())
    result["bf16_mixed"] = {
        "base_dtypes": sorted({str(p.dtype) for p in params.values() if not p.requires_grad}),
        "adapter_dtypes": sorted({str(p.dtype) for p in params.values() if p.requires_grad}),
        "base_unchanged": all(torch.equal(whole(params[n].detach()), t) for n, t in base_before.items()),
        "adapter_moved": max(
            float((whole(p.detach()) - lora.initial_factor(n, p.shape, 5)).abs().max())
            for n, p in params.items()
            if lora.is_factor(n)
        ),
    }
    with open(f"{out}.{dist.get_rank()}", "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    leave()  # the groups destroyed, no interpreter teardown (ranks.leave: a finished gloo rank aborted there)


if __name__ == "__main__":
    main(*sys.argv[1:])
