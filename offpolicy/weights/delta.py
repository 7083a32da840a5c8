"""Delta versions: a published version written as the values that changed since the version before it.

At RL learning rates most values of the published dtype do not change from one version to the next (an
Adam step moves a weight by about the learning rate, one bf16 step of a weight of 0.02 is ~8e-5). A delta
version folder `v<version>/` holds, in place of the weights:

- `delta.safetensors`: per tensor that changed, one `U8` tensor under the tensor's name: its changes
  compressed with zstd, encoded as whichever is smaller raw: `sparse` (the changed positions as uint32
  gaps, then their new values' bits) or `xor` (the new bits XOR the old, dense); a tensor that did not
  change has no entry;
- `delta.json`: the version it applies to (`base`), and every tensor of the full version in file order:
  name, shape, dtype, encoding, the count of changed values, and the sha256 of its bytes after applying;
- `config.json`, the tokenizer's files (as in a full version) and `manifest.json`, whose `base` names the
  base version (`manifest_base`); its `sha256` (the policy record's) is the delta file's own.

Applying is bit-exact: values are compared and replaced as bit patterns, never as numbers. The actor
applies a chain (the newest full version, then each delta after it) and checks every tensor's sha256
before it writes the full version it serves (actors/transport/delta_chain.py); the learner writes it
(learner/persist/delta_versions.py). The bits are read and written as integer views: any dtype works.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from offpolicy.weights.manifest import read_manifest

DELTA_WEIGHTS = "delta.safetensors"
DELTA_INDEX = "delta.json"
ZSTD_LEVEL = 1
"""zstd's level: the fastest; the payloads are mostly gaps and sparse bits, which level 1 already packs."""
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class DeltaMismatch(ValueError):
    """A delta that does not apply: a tensor's checksum after applying, a missing payload, a base of
    another shape. The version must be loaded from a full version instead."""


def bits(t: torch.Tensor) -> np.ndarray:
    """The flat bit patterns of a CPU tensor as a numpy integer array (a view, no copy)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_INT[flat.element_size()]).numpy()


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of a CPU tensor's raw bytes (what a safetensors file holds for it)."""
    return hashlib.sha256(memoryview(bits(t)).cast("B")).hexdigest()


@dataclass(frozen=True, slots=True)
class Encoded:
    """One tensor's change: `encoding` (same | sparse | xor), the count of changed values, the payload."""

    encoding: str
    changed: int
    payload: bytes


def encode(old: torch.Tensor, new: torch.Tensor) -> Encoded:
    """The change from `old` to `new` (same shape and dtype), bit for bit."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaMismatch(f"base {tuple(old.shape)} {old.dtype} vs new {tuple(new.shape)} {new.dtype}")
    a, b = bits(old), bits(new)
    x = np.bitwise_xor(a, b)
    where = np.flatnonzero(x)
    k, n, size = len(where), x.size, x.itemsize
    if k == 0:
        return Encoded("same", 0, b"")
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    if k * (4 + size) < n * size and n < 2**32:
        gaps = np.empty(k, dtype=np.uint32)
        gaps[0] = where[0]
        np.subtract(where[1:], where[:-1], out=gaps[1:], casting="unsafe")
        return Encoded("sparse", k, cctx.compress(gaps.tobytes() + b[where].tobytes()))
    return Encoded("xor", k, cctx.compress(x.tobytes()))


def apply(base: torch.Tensor, encoding: str, changed: int, payload: bytes) -> torch.Tensor:
    """A new tensor: `base` with the change applied (`base` is not modified)."""
    out = base.detach().clone().contiguous()
    if encoding == "same":
        return out
    o = bits(out)
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload)
    except zstandard.ZstdError as e:
        raise DeltaMismatch(f"payload does not decompress: {e}") from e
    if encoding == "sparse":
        if len(raw) != changed * (4 + o.itemsize):
            raise DeltaMismatch(f"sparse payload of {len(raw)} bytes for {changed} values")
        gaps = np.frombuffer(raw, dtype=np.uint32, count=changed)
        where = np.cumsum(gaps, dtype=np.int64)
        if changed and where[-1] >= o.size:
            raise DeltaMismatch(f"a changed position {int(where[-1])} past the tensor's {o.size} values")
        o[where] = np.frombuffer(raw, dtype=o.dtype, offset=4 * changed)
    elif encoding == "xor":
        if len(raw) != o.nbytes:
            raise DeltaMismatch(f"xor payload of {len(raw)} bytes for a tensor of {o.nbytes}")
        np.bitwise_xor(o, np.frombuffer(raw, dtype=o.dtype), out=o)
    else:
        raise DeltaMismatch(f"unknown encoding {encoding!r}")
    return out


# --- the folder


def manifest_base(folder: str | Path) -> int | None:
    """The base version of a published folder (a delta version), or None (a full version, or no manifest)."""
    doc = read_manifest(folder)
    return None if doc is None else doc.get("base")


@dataclass(frozen=True, slots=True)
class DeltaIndex:
    """`delta.json`: the base version and every tensor of the full version, in file order."""

    base: int
    tensors: list[dict[str, Any]]  # name, shape, dtype, encoding, changed, sha256

    def encode(self) -> bytes:
        return json.dumps({"base": self.base, "tensors": self.tensors}, indent=None).encode()

    @classmethod
    def read(cls, folder: str | Path) -> DeltaIndex:
        path = Path(folder) / DELTA_INDEX
        try:
            doc = json.loads(path.read_text())
            tensors = doc["tensors"]
            for t in tensors:
                if not (
                    isinstance(t["name"], str)
                    and t["dtype"] in DTYPES
                    and t["encoding"] in ("same", "sparse", "xor")
                    and isinstance(t["changed"], int)
                    and isinstance(t["sha256"], str)
                    and all(isinstance(d, int) for d in t["shape"])
                ):
                    raise ValueError(f"malformed entry {t!r}")
            return cls(int(doc["base"]), tensors)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DeltaMismatch(f"{path}: {e}") from e


def index_entry(name: str, t: torch.Tensor, enc: Encoded, sha: str) -> dict[str, Any]:
    """`delta.json`'s entry for tensor `name` (its new value `t`)."""
    return {
        "name": name,
        "shape": list(t.shape),
        "dtype": DTYPE_NAMES[t.dtype],
        "encoding": enc.encoding,
        "changed": enc.changed,
        "sha256": sha,
    }


def payloads(folder: str | Path) -> Mapping[str, bytes]:
    """The changed tensors' payloads of a delta folder, by tensor name."""
    from safetensors.numpy import load_file

    return {k: v.tobytes() for k, v in load_file(str(Path(folder) / DELTA_WEIGHTS)).items()}
