"""Run by torchrun from test_expert_parallel.py (N ranks, gloo): one Qwen3-MoE experts module cut by
`shard_experts` (EP over `ep` ranks, FSDP2 over the rest) against the same module on one process, for
routings given by a seed; `skewed` sends every token to the first ep rank's experts (the others receive
nothing). Each rank feeds its own tokens; rank 0 checks the concatenated outputs and the experts' full
gradients (FSDP2-reduced, each rank's loss scaled by N as the learner scales it) against the one-process
ones and writes the largest differences as JSON. Arguments: EP OUT."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from offpolicy.learner.distributed import init_from_env
from offpolicy.learner.distributed.expert_parallel import shard_experts

EXPERTS, TOP_K, HIDDEN, TOKENS = 8, 2, 64, 12  # tokens per rank


def experts() -> Qwen3MoeExperts:
    """The same weights on every rank (seeded), run as grouped GEMMs."""
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=32, num_experts=EXPERTS)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(std=0.1)
        module.down_proj.normal_(std=0.1)
    return module


def routing(world: int, seed: int, skewed: bool, ep: int) -> tuple[torch.Tensor, ...]:
    """Every rank's tokens (W T, H), top-k experts (W T, k) and weights (W T, k); a loss weight (W T, H)."""
    gen = torch.Generator().manual_seed(seed)
    n = world * TOKENS
    hidden = torch.randn(n, HIDDEN, generator=gen)  # (W T, H)
    experts = EXPERTS // ep if skewed else EXPERTS  # skewed: the first ep rank's experts alone
    index = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(n)])  # (W T, k)
    weights = torch.softmax(torch.randn(n, TOP_K, generator=gen), -1)  # (W T, k)
    return hidden, index, weights, torch.randn(n, HIDDEN, generator=gen)


def main(ep: int, out: str) -> None:
    ranks = init_from_env("cpu")
    world, me = ranks.world_size, ranks.rank
    whole, parallel = experts(), experts()
    shard_experts(parallel, ep, torch.device("cpu"), {})
    diffs: dict[str, float] = {}
    for name, seed, skewed in (("random", 1, False), ("skewed", 2, True)):
        hidden, index, weights, target = routing(world, seed, skewed, ep)
        want = whole(hidden, index, weights)  # (W T, H)
        (want * target).sum().backward()
        mine = slice(me * TOKENS, (me + 1) * TOKENS)
        got = parallel(hidden[mine], index[mine], weights[mine])  # (T, H)
        (world * (got * target[mine])).sum().backward()
        outs = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(outs, got.detach())
        diffs[f"{name}/output"] = float((torch.cat(outs) - want).abs().max())
        for p in ("gate_up_proj", "down_proj"):
            full = getattr(parallel, p).grad.full_tensor()  # (E, ...)
            diffs[f"{name}/{p}.grad"] = float((full - getattr(whole, p).grad).abs().max())
            diffs[f"{name}/{p}.grad_norm"] = float(getattr(whole, p).grad.abs().max())
        whole.zero_grad()
        parallel.zero_grad()
    if me == 0:
        with open(out, "w") as fh:
            json.dump(diffs, fh)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
