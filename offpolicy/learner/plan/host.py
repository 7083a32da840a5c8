"""The host memory plan of a learner node, estimated before any weight is loaded, and refused at start when
it exceeds the container's memory limit (its cgroup's `memory.max`).

Per rank, for P parameters sharded over S ranks (FSDP2; S = 1 on one process; a mixture-of-experts model's
P counts every expert, learner/plan/shape.py `total`: each is checkpointed, published and offloaded):

- `process`: CUDA context, Python, NCCL, the libraries: 4 GiB (`PROCESS_BYTES`).
- `startup`: what the build reads before the weights are on the device: lean start, the rank's fp32 shards
  (4 B x P / S); the eager start (`fsdp.lean_start: false`) and one process, the whole fp32 model (4 B x P).
  Freed before training: the plan counts the larger of it and the training's own parts.
- `checkpoint_stager`: N ranks with `checkpoint.async_staging`: DCP's stager keeps the rank's fp32 masters
  and AdamW's two moments in (pinned, on CUDA) host memory for the run, 12 B x P / S; one process: the
  checkpoint's host copy of the same, 12 B x P, while a checkpoint is written.
- `publish_snapshot`: N ranks: the rank's shards in the publish dtype (the checkpoint's; bf16 counted) for
  the background gather, 2 B x P / S, twice (one gathering, the newest waiting while the previous one is
  gathered, written or sent: persist/rank_gathers.py). A snapshot is one
  host set of exactly its tensors' bytes (page-locked at that size on CUDA, never through torch's pinned
  cache, which rounds each buffer to a power of two: weights/host_buffers.py), reused version after
  version: no other snapshot is ever alive.
- `published_sets`: the leader: one process and N ranks with a transport that sends from the leader's host
  memory (`publish.transport: vllm` with a broadcast backend): the full weights in the publish dtype, up
  to two sets (the writer reads one while the next snapshot fills the other; a newer snapshot takes the
  waiting one's set), 2 x 2 B x P in bf16, host sets as above; N ranks
  otherwise: the gather streams into the version's files, (`STREAM_DEPTH` + 2) buckets of
  `publish.gather_bucket_mb` (persist/background_gather.py).
- `cpu_offload`: `fsdp.cpu_offload`: the rank's fp32 masters, gradients and AdamW state, 16 B x P / S.
- `reference`: `reference.cpu_offload`: the KL reference's weights in the compute dtype (2 B x P / S);
  none under LoRA without `reference.model_path` (the policy with its adapter off, no second copy).

Under LoRA (`lora`, an adapter of A parameters) the checkpoint stager, the publish snapshot and sets hold
the adapter alone (A in place of P); the frozen base is in the compute dtype (2 B x P under `bf16_mixed`,
in `startup` and `cpu_offload`) beside the adapter's masters, gradients and moments (16 B x A / S).
- `delta_base`: the leader with `publish.delta`: the last published version in the publish dtype, what the
  next delta is computed against (learner/persist/delta_versions.py), 2 B x P; with `transport: vllm` on
  the `gloo` backend also the last round every member of the transfer group holds (the engine's delta
  rounds, weights/engines/delta_rounds.py), 2 B x P more.
- `teacher`: `teacher.cpu_offload`: the distillation teacher's weights in the compute dtype (2 B x P_teacher
  / S, P_teacher its own parameters).

A node holds `ranks_per_node` ranks; the leader's node adds the leader's parts. `check` refuses a node plan
above the cgroup limit, naming the parts and the knobs that lower them.

The measured side, `PeakHostMemory`: a process's peak host memory over a stretch of code (the learner's
start-up), from the kernel's counters. It resets the kernel's high-water mark of this process's resident
set (`VmHWM`, by writing 5 to /proc/self/clear_refs, Linux 4.0+) on entry and reads it on exit:
`peak_bytes` is the largest resident set seen in between, `added_bytes` that peak minus the resident set
at entry. Without
/proc/self/clear_refs it falls back to `getrusage`'s `ru_maxrss`, which cannot be reset (the peak since
the process started: an upper bound).
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from offpolicy.learner.config.publish import STREAM_DEPTH
from offpolicy.learner.errors import MemoryPlanError

if TYPE_CHECKING:
    from offpolicy.learner.config import LearnerConfig

GIB = 2**30
PROCESS_BYTES = 4 * GIB
CGROUP_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@dataclass(frozen=True)
class HostPlan:
    """Host bytes of one learner rank, by part."""

    process: int
    startup: int
    checkpoint_stager: int
    publish_snapshot: int
    published_sets: int
    cpu_offload: int
    reference: int
    teacher: int = 0
    delta_base: int = 0

    @property
    def steady(self) -> int:
        return (
            self.delta_base
            + self.checkpoint_stager
            + self.publish_snapshot
            + self.published_sets
            + self.cpu_offload
            + self.reference
            + self.teacher
        )

    @property
    def total(self) -> int:
        """The rank's peak: the process plus the start-up reads or the training's parts, whichever is more."""
        return self.process + max(self.startup, self.steady)

    def as_dict(self) -> dict[str, float]:
        return {k: v / GIB for k, v in asdict(self).items()} | {"total": self.total / GIB}


def host_plan(
    config: LearnerConfig,
    params: int,
    shard_ranks: int,
    distributed: bool,
    leader: bool,
    teacher_params: int | None = None,
    adapter_params: int = 0,
) -> HostPlan:
    """The host plan of one rank training `params` parameters sharded over `shard_ranks` ranks (the
    distillation teacher's `teacher_params`; None = `params`); under LoRA its adapter has `adapter_params`
    (plan/memory.py `adapter_params`): what is trained, checkpointed and published."""
    share = shard_ranks if distributed else 1
    lora = config.lora is not None
    trained = adapter_params if lora else params  # what AdamW holds, a checkpoint saves, a version publishes
    compute = 4 if config.precision == "fp32" else 2
    # the weights' bytes: fp32 masters, or under LoRA the frozen base in the compute dtype + the adapter's
    weights = compute * params + 4 * adapter_params if lora else 4 * params
    publish = 2  # the checkpoint's dtype, bf16 for the models this plans for
    # N ranks: the leader keeps the gathered weights for a transport that sends them (publisher.py)
    keep = config.publish.transport == "vllm" and not config.publish.transfer.sharded
    streamed = distributed and not keep
    bucket = config.publish.gather_bucket_mb * 2**20
    lean = distributed and config.fsdp.lean_start
    stager = (
        12 * trained // share
        if (config.checkpoint_path is not None and (config.checkpoint.async_staging or not distributed))
        else 0
    )
    own_reference = config.kl_loss_coef > 0 and not config.adapter_reference  # a second copy is loaded
    deltas = config.publish.delta != "off" and not lora
    rounds = config.publish.transport == "vllm" and config.publish.transfer.backend == "gloo"
    return HostPlan(
        process=PROCESS_BYTES,
        startup=weights // share if lean else weights,
        checkpoint_stager=stager,
        publish_snapshot=2 * publish * trained // share if distributed else 0,
        published_sets=(
            0 if not leader else (STREAM_DEPTH + 2) * bucket if streamed else 2 * publish * trained
        ),
        cpu_offload=(weights + 12 * trained) // share if distributed and config.fsdp.cpu_offload else 0,
        reference=compute * params // share if own_reference and config.reference.cpu_offload else 0,
        teacher=compute * (teacher_params or params) // share
        if config.teacher.model_path is not None and config.teacher.cpu_offload
        else 0,
        delta_base=publish * params * (2 if rounds else 1) if leader and deltas else 0,
    )


def node_bytes(
    config: LearnerConfig,
    params: int,
    shard_ranks: int,
    ranks_per_node: int,
    leader_node: bool,
    teacher_params: int | None = None,
    adapter_params: int = 0,
) -> int:
    """Host bytes of one node's ranks (the leader's node: one leader and `ranks_per_node - 1` others)."""
    distributed = shard_ranks > 1 or ranks_per_node > 1
    other = host_plan(config, params, shard_ranks, distributed, False, teacher_params, adapter_params).total
    if not leader_node:
        return ranks_per_node * other
    leader = host_plan(config, params, shard_ranks, distributed, True, teacher_params, adapter_params).total
    return leader + (ranks_per_node - 1) * other


def cgroup_limit() -> int | None:
    """This container's memory limit in bytes (cgroup v2 or v1), or None when there is none."""
    for path in CGROUP_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text and text != "max" and int(text) < 2**60:
            return int(text)
    return None


def check(
    config: LearnerConfig,
    params: int,
    shard_ranks: int,
    ranks_per_node: int,
    leader_node: bool,
    limit: int | None,
    teacher_params: int | None = None,
    adapter_params: int = 0,
) -> int:
    """The node's planned host bytes; `MemoryPlanError` when they exceed `limit` (None: no limit)."""
    need = node_bytes(
        config, params, shard_ranks, ranks_per_node, leader_node, teacher_params, adapter_params
    )
    if limit is None or need <= limit:
        return need
    distributed = shard_ranks > 1 or ranks_per_node > 1
    plan = host_plan(config, params, shard_ranks, distributed, leader_node, teacher_params, adapter_params)
    parts = ", ".join(f"{k} {v:.1f}" for k, v in plan.as_dict().items() if k != "total")
    raise MemoryPlanError(
        f"the host memory plan of this node needs ~{need / GIB:.1f} GiB ({ranks_per_node} rank(s); the "
        f"{'leader' if leader_node else 'rank'}'s parts: {parts} GiB) but the container's limit is "
        f"{limit / GIB:.1f} GiB: raise the pod's memory limit, set checkpoint.async_staging: false (now "
        f"{config.checkpoint.async_staging}: DCP's pinned stager), fsdp.cpu_offload: false (now "
        f"{config.fsdp.cpu_offload}), or shard over more ranks"
    )


_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakHostMemory:
    """`with PeakHostMemory() as m: ...` then `m.added_bytes`, `m.peak_bytes`, `m.base_bytes`."""

    def __init__(self) -> None:
        self.base_bytes = 0
        self.peak_bytes = 0
        self.exact = False  # the high-water mark was reset at entry (else: ru_maxrss, an upper bound)

    def __enter__(self) -> PeakHostMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.exact = _status_kib("VmHWM") is not None
        except OSError:
            self.exact = False
        self.base_bytes = (_status_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        hwm = _status_kib("VmHWM") if self.exact else None
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        self.peak_bytes = hwm * 1024

    @property
    def added_bytes(self) -> int:
        return max(0, self.peak_bytes - self.base_bytes)
