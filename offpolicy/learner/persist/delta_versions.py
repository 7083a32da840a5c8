"""The learner's delta versions (`publish.delta`): which version is written whole, which as its changes.

The format is weights/delta.py's. `DeltaVersions` holds the last published version's tensors in the
publish dtype, in the folder's layout (`base`: host memory the size of one full version, on the rank
that writes, counted by the host plan), and decides per version:

- full when there is no base (the first publish, after a restart, after a failed write), every
  `publish.full_every`-th version of a chain, or when the delta comes out larger than the share of a full
  version allowed (`on`: 1.0, `auto`: `publish.delta_share`; the encoding stops as soon as it passes it);
- else a delta against the base.

Either way each tensor, as it is written, replaces the base's copy, and the base counts as the new
version only once the folder is in place (`commit`); a write that fails leaves no base, so the next
version is full: a delta never refers to a version the actors could not have.
"""

from __future__ import annotations

import collections
import logging
import math
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from offpolicy.weights.delta import (
    DELTA_INDEX,
    DELTA_WEIGHTS,
    DeltaIndex,
    encode,
    index_entry,
    tensor_sha256,
)
from offpolicy.weights.safetensors_io import Entry, write_safetensors, write_small

if TYPE_CHECKING:
    from offpolicy.learner.config import LearnerConfig

log = logging.getLogger(__name__)

ENCODERS = max(1, min(8, (os.cpu_count() or 2) // 2))
"""Threads encoding a delta's tensors (half the cores, at most 8: the writer shares the host with
training)."""


class DeltaVersions:
    """The base the next delta is computed against, and the full-or-delta choice (module docstring)."""

    def __init__(self, mode: str, full_every: int, share: float) -> None:
        self.mode, self.full_every = mode, full_every
        self.share = 1.0 if mode == "on" else share
        self.base: dict[str, torch.Tensor] = {}
        self.base_version: int | None = None
        self.chain = 0  # deltas written since the last full version
        self.last: dict[str, Any] = {}  # the last version's figures (kind, bytes, changed share)

    @classmethod
    def of(cls, config: LearnerConfig, writer: bool) -> DeltaVersions | None:
        """The learner's, when `publish.delta` is on and this rank writes the versions (none under LoRA:
        an adapter is published whole)."""
        pc = config.publish
        if pc.delta == "off" or config.lora is not None or not writer:
            return None
        return cls(pc.delta, pc.full_every, pc.delta_share)

    @property
    def bytes_share(self) -> float:
        """The last version's bytes over a full version's (1.0 when it was written whole)."""
        last = self.last
        return last["bytes"] / last["full_bytes"] if last.get("kind") == "delta" else 1.0

    @property
    def base_bytes(self) -> int:
        """Host memory the base holds."""
        return sum(t.nbytes for t in self.base.values())

    def wants_delta(self) -> bool:
        return self.mode != "off" and self.base_version is not None and self.chain + 1 < self.full_every

    def _keep(self, name: str, t: torch.Tensor) -> None:
        held = self.base.get(name)
        if held is None or held.shape != t.shape or held.dtype != t.dtype:
            self.base[name] = t.detach().clone()
        else:
            held.copy_(t)

    def recording(self, take: Callable[[Entry], torch.Tensor]) -> Callable[[Entry], torch.Tensor]:
        """`take` for a full write: each tensor also becomes the base's (the base is invalid until
        `commit`)."""
        self.base_version = None
        if self.mode == "off":
            return take

        def took(entry: Entry) -> torch.Tensor:
            t = take(entry)
            self._keep(entry[0], t)
            return t

        return took

    def _encode(self, name: str, new: torch.Tensor) -> tuple[dict[str, Any], bytes] | None:
        """One tensor's `delta.json` entry and payload (None: the base lacks it); `new` becomes the base's.
        Runs on the encoding pool: numpy, zstd and hashlib release the GIL on large buffers."""
        old = self.base.get(name)
        out = None
        if old is not None and old.shape == new.shape and old.dtype == new.dtype:
            enc = encode(old, new)
            out = index_entry(name, new, enc, tensor_sha256(new)), enc.payload
        self._keep(name, new)
        return out

    def write_delta(
        self, folder: Path, entries: list[Entry], take: Callable[[Entry], torch.Tensor]
    ) -> dict[str, dict[str, Any]] | None:
        """Write `delta.safetensors` and `delta.json` of the tensors `take` gives (every entry is taken, in
        order, and becomes the base's); None when the delta passes the allowed share (nothing written:
        the caller writes the full version from `base`). Tensors are encoded on `ENCODERS` threads, at
        most twice as many in flight (a streamed version is never held whole)."""
        base, self.base_version = self.base_version, None
        assert base is not None
        full = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)
        limit = self.share * full
        payload: dict[str, torch.Tensor] = {}
        index: list[dict[str, Any]] = []
        size, changed, values, over = 0, 0, 0, False
        pending: collections.deque[Future] = collections.deque()

        def collect(job: Future) -> None:
            nonlocal size, changed, values, over
            got = job.result()
            if got is None:
                over = True  # a tensor the base lacks (another model): whole
                return
            entry, blob = got
            index.append(entry)
            if blob:
                payload[entry["name"]] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            size += len(blob)
            changed += entry["changed"]
            values += math.prod(entry["shape"])
            over = over or size > limit

        with ThreadPoolExecutor(ENCODERS, thread_name_prefix="offpolicy-delta") as pool:
            for entry in entries:
                pending.append(pool.submit(self._encode, entry[0], take(entry)))
                while len(pending) > 2 * ENCODERS or (pending and pending[0].done()):
                    collect(pending.popleft())
            while pending:
                collect(pending.popleft())
        if over:
            log.info("delta over %.2f of a full version: this version is written whole", self.share)
            return None
        files = {DELTA_WEIGHTS: write_safetensors(folder / DELTA_WEIGHTS, payload)}
        files[DELTA_INDEX] = write_small(folder / DELTA_INDEX, DeltaIndex(base, index).encode())
        self.last = {
            "kind": "delta",
            "base": base,
            "bytes": size,
            "full_bytes": full,
            "changed_share": changed / max(1, values),
        }
        return files

    def commit(self, version: int, delta: bool) -> None:
        """The version is in place: its tensors are the base from now on."""
        if self.mode == "off":
            return
        self.base_version = version
        self.chain = self.chain + 1 if delta else 0
        if not delta:
            self.last = {"kind": "full"}
