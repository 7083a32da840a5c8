"""`benchmarks/learner.py --shape longtail-1.3b|longtail-4b --profile`: where one learner step's time goes.

One more step after the measured ones runs under `torch.profiler`. On CUDA every kernel's device time is
summed by kind (`KINDS`: matrix products, attention, copies and casts, collectives, the rest: elementwise
and reductions, compiled Triton kernels included), and `device_busy_share` is the kernels' time over the
step's wall time: well under 1 means the GPU waits on the host (launches, Python, synchronisation), which
no kernel makes faster. On CPU the same kinds are summed over the operators' own CPU time, views and
allocations apart as `other` (a smoke check of the path; CPU operators overlap across threads, so no busy
share). `top` lists the costliest kernels.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType

KINDS = (  # (kind, name fragments, lower-case), first match wins
    ("attention", ("flash", "fmha", "attention", "attn", "varlen")),
    ("collective", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter")),
    ("matmul", ("gemm", "cutlass", "nvjet", "cublas", "xmma", "triton_tem", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::_addmm", "aten::baddbmm")),
    ("elementwise", ("triton_",)),  # Inductor's fused kernels ("triton_red_fused__to_copy_add_...")
    ("copy", ("memcpy", "memset", "copy", "aten::cat", "catarray", "aten::clone", "aten::_to_copy",
              "aten::contiguous")),
)  # fmt: skip
"""Kernel or operator name fragments per kind; anything else is `elementwise` (pointwise, reductions,
norms, softmax)."""
HOST_ONLY = frozenset(f"aten::{op}" for op in (
    "empty", "empty_strided", "slice", "as_strided", "transpose", "view", "select", "unsqueeze", "expand",
    "t", "reshape", "permute", "detach", "alias", "_unsafe_view", "squeeze", "split", "lift_fresh",
))  # fmt: skip
"""CPU operators that run no kernel (views, allocations): kind `other`."""


def kind(name: str) -> str:
    """The kind of a kernel or operator by its name: `other` for `HOST_ONLY`, else by `KINDS`, else
    `elementwise`."""
    if name in HOST_ONLY:
        return "other"
    low = name.lower()
    return next((k for k, parts in KINDS if any(p in low for p in parts)), "elementwise")


def summarize(events: list[tuple[str, float, int]], wall_s: float, device: bool, top: int = 12) -> dict:
    """`events`: (name, self seconds, calls) of every kernel (`device`) or CPU operator. The seconds and
    share per kind, the busy share (device only) and the `top` costliest by seconds."""
    total = sum(s for _, s, _ in events)
    by_kind: dict[str, float] = defaultdict(float)
    for name, s, _ in events:
        by_kind[kind(name)] += s
    kinds = {k: {"s": by_kind.get(k, 0.0), "share": by_kind.get(k, 0.0) / total if total else 0.0}
             for k in ("matmul", "attention", "elementwise", "copy", "collective", "other")}  # fmt: skip
    ranked = sorted(events, key=lambda e: e[1], reverse=True)[:top]
    return {
        "step_s": wall_s,
        "measured": "kernels" if device else "cpu_operators",
        "total_s": total,
        "device_busy_share": total / wall_s if device and wall_s > 0 else None,
        "kinds": kinds,
        "top": [{"name": n[:120], "s": s, "calls": c, "kind": kind(n)} for n, s, c in ranked],
    }


def profile_step(step: Callable[[], object], device: torch.device) -> dict:
    """Run `step` once under the profiler; `summarize` its kernels (CUDA) or CPU operators."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    events = []
    for e in prof.key_averages():
        if cuda and e.device_type == DeviceType.CUDA:
            events.append((e.key, e.self_device_time_total / 1e6, e.count))
        elif not cuda and e.device_type == DeviceType.CPU and e.key.startswith("aten::"):
            events.append((e.key, e.self_cpu_time_total / 1e6, e.count))
    return summarize(events, wall, cuda)


def profile_lines(profile: dict) -> str:
    """The `--profile` summary as text: each kind's seconds and share, the busy share, the top kernels."""
    busy = profile["device_busy_share"]
    lines = [f"profiled step {profile['step_s']:.2f} s, {profile['measured']} {profile['total_s']:.2f} s"
             + ("" if busy is None else f" (device busy {busy:.0%})")]  # fmt: skip
    lines += [f"  {k:<12} {v['s']:8.3f} s  {v['share']:6.1%}" for k, v in profile["kinds"].items()]
    lines += [f"  {t['s']:8.3f} s  {t['calls']:6d}x  {t['kind']:<11} {t['name']}" for t in profile["top"]]
    return "\n".join(lines)
