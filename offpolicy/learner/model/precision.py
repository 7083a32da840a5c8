"""Numerical precision of the learner: master weights, optimizer state and compute dtype, by one name.

- `bf16_mixed` (default on CUDA): fp32 master weights and AdamW state; forward and backward run under
  `torch.autocast(bfloat16)`. Small updates (lr 1e-6 on weights of size ~1e-2) land in the fp32 masters.
- `fp32` (default on CPU): everything in float32, no autocast.
- `bf16_pure` (opt-in): weights and AdamW state in bfloat16. Half the memory of the masters, but an update
  smaller than bf16's rounding step at the weight's magnitude (~0.4 % of it) is lost: at lr 1e-6 most
  weights never move. Use it only where memory leaves no other choice.

Published weights are the master weights cast to the model's own dtype (`config.dtype` of the checkpoint
the learner loaded, e.g. bf16 for a Llama release, fp32 for the tiny test model).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from offpolicy.learner.config import PrecisionName


@dataclass(frozen=True, slots=True)
class Precision:
    """What a precision name means on a device: the parameters' dtype and the autocast dtype (or None)."""

    name: PrecisionName
    device: torch.device
    param_dtype: torch.dtype  # master weights and optimizer state
    compute_dtype: torch.dtype | None  # autocast dtype; None = compute in param_dtype

    @classmethod
    def resolve(cls, name: PrecisionName | None, device: torch.device) -> Precision:
        """`name` on `device`; None = `bf16_mixed` on CUDA, `fp32` elsewhere."""
        name = name or ("bf16_mixed" if device.type == "cuda" else "fp32")
        if name == "bf16_mixed":
            return cls(name, device, torch.float32, torch.bfloat16)
        if name == "bf16_pure":
            return cls(name, device, torch.bfloat16, None)
        return cls(name, device, torch.float32, None)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The context every forward pass of the learner runs in (a no-op without a compute dtype)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


def pick_device(device: str | None = None) -> torch.device:
    """`device`, or CUDA when available, else CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
