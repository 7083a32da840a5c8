"""Safetensors files written as a stream: each tensor taken in its turn (from memory, or from a stream of
chunks as the N-rank gather delivers them), every byte hashed once as it is written (sha256 per file), the
file fsynced. The header is known before any tensor arrives (names, shapes, dtypes), so a writer never
holds a whole set: published weights (persist/file_generation.py) and checkpoints' model files use it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class HashingFile:
    """A binary file opened for writing whose bytes also feed its sha256."""

    def __init__(self, path: Path) -> None:
        self.fh = path.open("wb")
        self.own = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)
        self.own.update(data)
        self.bytes += len(data)

    def close(self) -> dict[str, Any]:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        return {"bytes": self.bytes, "sha256": self.own.hexdigest()}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write `tensors` in the safetensors format, hashing as it writes; return {"bytes", "sha256"}."""
    entries = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    return write_streamed(path, entries, lambda e: tensors[e[0]])


Entry = tuple[str, tuple[int, ...], torch.dtype]
"""A tensor of a stream: (name, shape, dtype)."""


@dataclass(frozen=True)
class TensorStream:
    """Tensors of a known layout (`entries`, in file order) arriving as dicts (`chunks`) in that order: the
    N-rank gather's buckets (persist/background_gather.py) stream into the files as they arrive, so the
    leader never holds a full set; `whole` wraps a snapshot held in memory."""

    entries: list[Entry]
    chunks: Iterable[dict[str, torch.Tensor]]

    @classmethod
    def whole(cls, tensors: dict[str, torch.Tensor]) -> TensorStream:
        return cls([(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], [tensors])


def _nbytes(entry: Entry) -> int:
    return math.prod(entry[1]) * entry[2].itemsize


def shards_of(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = _nbytes(entry)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def _safetensors_header(entries: list[Entry]) -> bytes:
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype in entries:
        n = _nbytes((name, shape, dtype))
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-aligned, as the reference writer does
    return len(head).to_bytes(8, "little") + head


def write_streamed(path: Path, entries: list[Entry], take: Callable[[Entry], torch.Tensor]) -> dict:
    """One safetensors file of `entries`, each tensor taken (`take`) in its turn; hashed as written."""
    out = HashingFile(path)
    out.write(_safetensors_header(entries))
    for entry in entries:
        out.write(_tensor_bytes(take(entry)))
    return out.close()


class Arrivals:
    """Takes the tensors of a stream by name, reading its chunks as far as needed (in order)."""

    def __init__(self, chunks: Iterable[dict[str, torch.Tensor]]) -> None:
        self._chunks = iter(chunks)
        self._held: dict[str, torch.Tensor] = {}

    def take(self, entry: Entry) -> torch.Tensor:
        name, shape, dtype = entry
        while name not in self._held:
            chunk = next(self._chunks, None)
            if chunk is None:
                raise RuntimeError(f"the weights stream ended before {name}")
            self._held.update(chunk)
        t = self._held.pop(name)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RuntimeError(f"{name}: streamed {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
        return t

    def drain(self) -> None:
        """Read what is left (a failed write must not leave the producer blocked on a full queue)."""
        self._held.clear()
        for _ in self._chunks:
            pass


def write_small(path: Path, data: bytes) -> dict[str, Any]:
    out = HashingFile(path)
    out.write(data)
    return out.close()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_weight_files(
    tmp: Path, entries: list[Entry], take: Callable[[Entry], torch.Tensor], max_shard_bytes: int
) -> dict[str, dict[str, Any]]:
    """The weights as `model.safetensors`, or shards + their index past `max_shard_bytes` (named as
    transformers names them); {file name: {"bytes", "sha256"}}."""
    files: dict[str, dict[str, Any]] = {}
    shards = shards_of(entries, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards, strict=True):  # names sort in write order
        files[name] = write_streamed(tmp / name, shard, take)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(f["bytes"] for f in files.values())},
            "weight_map": {t[0]: n for n, shard in zip(names, shards, strict=True) for t in shard},
        }
        files["model.safetensors.index.json"] = write_small(
            tmp / "model.safetensors.index.json", json.dumps(index, indent=1).encode()
        )
    return files
