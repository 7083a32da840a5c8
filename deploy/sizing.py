"""Sizing of a deployment for 1.5B, 7B and 70B models and two mixture-of-experts models (Qwen3-30B-A3B,
DeepSeek-V3): GPUs, host memory, volumes, Redis memory.

The arithmetic of docs/deploy.md "Sizing", as code, so that the table there and the shipped manifests'
defaults (the 7B row) are checked against it (tests/unit/deploy/test_sizing.py):

- learner GPUs: the fewest ranks (1, 2, 4, 8, then whole 8-GPU nodes) whose memory plan per rank
  (`offpolicy.learner.plan.memory.estimate`, the same the learner refuses to start above) fits 90 % of an 80
  GiB GPU,
  with configs/learner.yaml's settings (bf16_mixed, packing, `micro_batch_tokens`, checkpointing on); a
  MoE model's plan counts every expert's weights, gradients and AdamW state (sharded over the ranks), the
  gathered layer's experts (/ `ep`, its expert-parallel size) and the routed activations; its shape is
  read from the committed config.json (deploy/models/<name>/config.json, plan/shape.py's counts);
- actor GPUs: vLLM's tensor-parallel size, the fewest GPUs holding the bf16 weights (2 B x P, every
  expert) in half of each GPU (the other half for the KV cache);
- host memory of the learner's first node (the leader's; the others hold less): the learner's own host plan
  (`offpolicy.learner.plan.host.node_bytes`, the plan it refuses to start above: DCP's pinned checkpoint
  stager, the background gather's snapshot, the leader's published sets, the lean start's reads, 4 GiB of
  process per rank); the pod adds its /dev/shm;
- weights volume: (`publish.keep_versions` + 1 being written) x 2 B x P (published in bf16);
- checkpoints volume: (`checkpoint.keep_checkpoints` + 1 being written) x 12 B x P (fp32 masters + AdamW's
  two fp32 moments);
- Redis: bytes per group = n x T x 12 (4 B token id + 4 B behaviour logprob + 4 B policy version, the
  codec's worst case: buffer/codec.py) + 4 B x prompt tokens + 4 B x n (lengths) + `GROUP_OVERHEAD`
  (header: ids, rewards, sampling, finish reasons; the entry's keys and index); x `buffer.max_size`
  groups, x 1.5 for Redis' own allocations, in whole 512 MiB, gives `maxmemory`; the container limit
  is 2 x that (the AOF rewrite forks: copy-on-write pages).

    python deploy/sizing.py        # the table, as docs/deploy.md shows it
    python deploy/sizing.py --learner learner.yaml --actor actor.yaml [--model-dir DIR] [--gpu-memory-gib 80]
                                   # your run: the same arithmetic on your configs and your model's shape

With your configs the row is your run's: T = the actor's `sampling.max_tokens`, n = `sampling.n`, the
prompt = `engine.max_model_len` - T, groups = the learner's `buffer.max_size`, ep = its
`fsdp.expert_parallel`, the model's shape from its config.json (`--model-dir`, else `model_path` where it
is a folder here or in the Hugging Face cache), and the learner's plan with everything the learner config
adds (the KL loss's reference, a teacher, LoRA, its token budgets).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import json

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.plan.host import node_bytes
from offpolicy.learner.plan.memory import GIB, HEADROOM, ModelShape, estimate

MODELS = Path(__file__).resolve().parent / "models"  # committed config.json files of the MoE rows
GPU_GIB = 80  # H100 / A100 80 GB
GROUP_OVERHEAD = 1024  # bytes: the frame's header and the entry's keys (checked against the codec)
SHM_GIB = 16  # the learner pod's /dev/shm (memory-backed: counts against the pod's limit)
BYTES_PER_TOKEN = 12  # int32 token id + float32 behaviour logprob + int32 policy version


@dataclass(frozen=True)
class Workload:
    """One row: a model and the run's sizes."""

    name: str
    shape: ModelShape
    response_tokens: int  # T: sampling.max_tokens
    prompt_tokens: int
    group_size: int  # n: sampling.n
    buffer_groups: int  # buffer.max_size
    ep: int = 1  # expert-parallel size (MoE): each MoE layer's experts divided over this many ranks


ROWS = (
    Workload("1.5B", ModelShape(1_543_714_304, 1536, 8960, 28, 151_936, 32_768), 1024, 512, 8, 10_000),
    # configs/*.yaml: max_tokens 1024, n 8, max_size 10000; the shipped manifests are sized for this row
    Workload("7B", ModelShape(7_615_616_512, 3584, 18_944, 28, 152_064, 32_768), 1024, 512, 8, 10_000),
    Workload("70B", ModelShape(70_553_706_496, 8192, 28_672, 80, 128_256, 131_072), 4096, 1024, 16, 10_000),
)
DEFAULT = "7B"


def config_json(name: str) -> dict:
    """deploy/models/<name>/config.json (the published model's, verbatim but for FP8 quantization and remote
    code keys, which a plan does not need)."""
    return json.loads((MODELS / name / "config.json").read_text())


MOE_ROWS = (
    Workload("Qwen3-30B-A3B", ModelShape.of_dict(config_json("qwen3-30b-a3b")), 4096, 1024, 16, 10_000),
    # its experts placed 8 to a node (ep 8): with ep 1 a gathered layer holds 2 x 11.3B parameters
    Workload("DeepSeek-V3", ModelShape.of_dict(config_json("deepseek-v3")), 4096, 1024, 16, 10_000, ep=8),
)
RANKS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 192, 256, 384, 512)


def ceil_to(value_gib: float, step: int) -> int:
    return step * math.ceil(value_gib / step)


def group_bytes(w: Workload) -> int:
    n, t = w.group_size, w.response_tokens
    return n * t * BYTES_PER_TOKEN + 4 * w.prompt_tokens + 4 * n + GROUP_OVERHEAD


@dataclass(frozen=True)
class Sizing:
    learner_gpus: int
    plan_gib: float  # the learner's memory plan per rank at that count
    actor_gpus: int
    host_gib_node: float  # the learner's first node: its ranks' host plan
    learner_pod_gib: int  # memory limit of one learner pod (its ranks + /dev/shm), whole 16 GiB
    weights_gib: int
    checkpoints_gib: int
    group_kib: float
    redis_maxmemory_mib: int
    redis_limit_gib: int


def size(w: Workload, config: LearnerConfig | None = None, gpu_gib: float = GPU_GIB) -> Sizing:
    cfg = config or LearnerConfig(model_path="unused")
    p = w.shape.params
    limit = HEADROOM * gpu_gib * GIB
    for gpus in (g for g in RANKS if g % w.ep == 0):
        plan = estimate(cfg, w.shape, gpus, gpus > 1, checkpointing=True, cuda=True, ep=w.ep)
        if plan.total <= limit:
            break
    else:
        raise ValueError(f"{w.name}: no rank count up to {RANKS[-1]} fits")
    actor = next(tp for tp in (1, 2, 4, 8, 16, 32, 64) if 2 * p / tp <= gpu_gib * GIB / 2)
    per_node = min(gpus, 8)
    host = node_bytes(cfg, p, gpus, per_node, leader_node=True) / GIB
    data = w.buffer_groups * group_bytes(w)
    maxmemory = 2**29 * math.ceil(1.5 * data / 2**29)  # whole 512 MiB
    return Sizing(
        learner_gpus=gpus,
        plan_gib=plan.total / GIB,
        actor_gpus=actor,
        host_gib_node=host,
        learner_pod_gib=ceil_to(host + SHM_GIB, 16),
        weights_gib=ceil_to((cfg.publish.keep_versions + 1) * 2 * p / GIB, 16),
        checkpoints_gib=ceil_to((cfg.checkpoint.keep_checkpoints + 1) * 12 * p / GIB, 16),
        group_kib=group_bytes(w) / 1024,
        redis_maxmemory_mib=maxmemory // 2**20,
        redis_limit_gib=math.ceil(2 * maxmemory / GIB),
    )


def table(config: LearnerConfig | None = None) -> str:
    """The markdown table of docs/deploy.md "Sizing"."""
    head = (
        "| model | T x n, prompt, groups | learner GPUs (plan/rank) | actor GPUs (TP) | host, node 0 "
        "| learner pod | weights | checkpoints | group | Redis maxmemory | Redis limit |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = []
    for w in ROWS + MOE_ROWS:
        s = size(w, config)
        rows.append(
            f"| {w.name} | {w.response_tokens} x {w.group_size}, {w.prompt_tokens}, {w.buffer_groups} "
            f"| {s.learner_gpus} ({s.plan_gib:.0f} GiB) | {s.actor_gpus} | {s.host_gib_node:.0f} GiB "
            f"| {s.learner_pod_gib} Gi | {s.weights_gib} Gi | {s.checkpoints_gib} Gi | {s.group_kib:.0f} KiB "
            f"| {s.redis_maxmemory_mib} mb | {s.redis_limit_gib} Gi |"
        )
    return head + "\n".join(rows) + "\n"


def workload(learner: LearnerConfig, actor: Any, shape: ModelShape, name: str = "your run") -> Workload:
    """The row of a run: the actor's completions and prompt room, the learner's buffer and expert split."""
    s = actor.sampling
    return Workload(
        name, shape, s.max_tokens, actor.engine.max_model_len - s.max_tokens, s.n,
        learner.buffer.max_size, ep=learner.fsdp.expert_parallel,
    )  # fmt: skip


def size_run(learner: LearnerConfig, actor: Any, shape: ModelShape, gpu_gib: float = GPU_GIB) -> Sizing:
    """`size` of a user's learner and actor configs on GPUs of `gpu_gib`."""
    return size(workload(learner, actor, shape), learner, gpu_gib)


def describe(s: Sizing, w: Workload, gpu_gib: float) -> str:
    """A run's sizes as lines: what to reserve, and where each figure goes."""
    return "\n".join([
        f"{w.name}: T {w.response_tokens} x n {w.group_size}, prompt {w.prompt_tokens}, "
        f"{w.buffer_groups} groups, {w.shape.params:,} parameters",
        f"learner GPUs: {s.learner_gpus} of {gpu_gib:g} GiB (plan {s.plan_gib:.1f} GiB per rank)",
        f"actor GPUs: {s.actor_gpus} per actor (engine.tensor_parallel_size)",
        f"host memory, the learner's first node: {s.host_gib_node:.0f} GiB (pod limit {s.learner_pod_gib} Gi "
        f"with {SHM_GIB} GiB /dev/shm)",
        f"weights volume: {s.weights_gib} Gi; checkpoints volume: {s.checkpoints_gib} Gi",
        f"Redis: {s.group_kib:.0f} KiB per group, maxmemory {s.redis_maxmemory_mib}mb "
        f"(REDIS_MAXMEMORY), container limit {s.redis_limit_gib} Gi",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    from offpolicy.actors.config import load_config as load_actor
    from offpolicy.learner.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learner", type=Path, help="your learner config (with --actor: your run's sizes)")
    parser.add_argument("--actor", type=Path, help="your actor config")
    parser.add_argument("--model-dir", type=Path, help="the model folder here (its config.json)")
    parser.add_argument(
        "--gpu-memory-gib", type=float, default=GPU_GIB, help="memory of one GPU (default 80)"
    )
    args = parser.parse_args(argv)
    if (args.learner is None) != (args.actor is None):
        parser.error("--learner and --actor go together")
    if args.learner is None:
        print(
            table(load_config(Path(__file__).resolve().parent.parent / "configs" / "learner.yaml", {})),
            end="",
        )
        return 0
    environ = {} if args.model_dir is None else {"OFFPOLICY_MODEL_PATH": str(args.model_dir.expanduser())}
    learner, actor = load_config(args.learner, environ), load_actor(args.actor, environ)
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(learner.model_path), local_files_only=True)
    except (OSError, ValueError) as e:
        print(f"model_path: its config.json cannot be read here (--model-dir): {e}", file=sys.stderr)
        return 1
    shape = ModelShape.of(hf, learner.lora)
    w = workload(learner, actor, shape)
    print(describe(size(w, learner, args.gpu_memory_gib), w, args.gpu_memory_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
