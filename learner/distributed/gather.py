"""Full weights of a sharded module, gathered into rank 0's host memory in the publish dtype.

`GatheredWeights` stands in for `persist.weights.HostCopy` when the learner runs on N ranks: every rank
constructs one at the same step boundary (a collective); only the leader's holds tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class GatheredWeights:
    """The full weights of a sharded module in rank 0's host memory, in the publish dtype (a collective:
    every rank constructs one; only the leader's holds tensors). Stands in for `persist.weights.HostCopy`.

    Each shard is cast to `dtype` on its own rank before the all-gather (a bf16 publish of fp32 masters
    moves half the bytes), the tensors are gathered one at a time (one full tensor on a device at once), and
    the leader copies each into its host buffers (`into` reused when shape and dtype match; pinned on CUDA)
    on the compute stream without blocking. `wait()` returns once the last copy has landed.
    """

    def __init__(
        self,
        module: nn.Module,
        keys: set[str],
        dtype: torch.dtype,
        leader: bool,
        into: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._done: torch.cuda.Event | None = None
        device: torch.device | None = None
        for name, t in module.state_dict().items():  # the same names in the same order on every rank
            if name not in keys:
                continue
            full = _full_tensor(t.detach(), dtype if t.is_floating_point() else t.dtype)
            if not leader:
                continue
            buf = into.get(name) if into is not None else None
            if buf is None or buf.shape != full.shape or buf.dtype != full.dtype:
                buf = torch.empty(full.shape, dtype=full.dtype, pin_memory=full.is_cuda)
            buf.copy_(full, non_blocking=full.is_cuda)  # same stream: `full`'s memory is reused only after
            self.tensors[name] = buf
            if full.is_cuda and self._done is None:
                self._done, device = torch.cuda.Event(), full.device
        if self._done is not None:
            self._done.record(torch.cuda.current_stream(device))  # the copies' stream, on their GPU

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until every copy has landed; return the host tensors (the leader's; empty elsewhere)."""
        if self._done is not None:
            self._done.synchronize()
        return self.tensors


def _full_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` whole, in `dtype`: a DTensor's shards cast, then all-gathered; a plain tensor only cast."""
    if not isinstance(t, DTensor):
        return t.to(dtype)
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:  # CPU-offloaded shards: NCCL gathers device tensors
        local = local.to(t.device_mesh.device_type)
    cast = DTensor.from_local(
        local.to(dtype), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
    return cast.full_tensor()
