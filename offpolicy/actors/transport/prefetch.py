"""Read a published version's files before the engine pauses: into the page cache, or a copy in memory.

The engine's reload reads the folder it is given (vLLM's `reload_weights` with a path, in the engine's
own worker processes). Without a prefetch those reads happen inside the generation pause: at 7B, 15 GB
from the shared volume per actor per version. `prefetch_folder` reads every file of the folder once while
the engine keeps generating, and verifies it on that same read (`reload.verify: full` hashes each byte as
it goes by; `manifest` checks the manifest and sizes first, without hashing):

- `page_cache`: the bytes land in the kernel's page cache, which the engine's processes share; its load
  then reads memory. The kernel may evict them under memory pressure (the load then reads the volume
  again, as without a prefetch); actors on one node share one cached copy.
- `memory`: the files are copied into `reload.prefetch_dir` (a tmpfs: host memory the kernel does not
  evict) and the engine loads the copy, which is deleted once loaded. Bounded by
  `reload.prefetch_max_bytes` and the tmpfs's free space; a larger folder falls back to `page_cache`.
- `none`: nothing is read before the pause.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from offpolicy.actors.transport.verify import manifest_of, verify_folder
from offpolicy.weights.manifest import MANIFEST

if TYPE_CHECKING:
    from offpolicy.actors.config import ReloadConfig

log = logging.getLogger(__name__)
_CHUNK = 8 << 20  # bytes read at a time


class Cancelled(Exception):
    """The prefetch was stopped (the actor is shutting down); nothing is left staged."""


@dataclass(frozen=True, slots=True)
class Prefetched:
    """A verified version, read ahead of its load."""

    version: int
    folder: Path  # the published folder (what the engine remembers as loaded, for restores)
    load_from: Path  # what the engine reads: `folder`, or its staged copy in memory
    where: str  # "memory" | "page_cache" | "none"
    bytes: int  # bytes read ahead (0 for "none")
    seconds: float  # time the read and the verification took

    def discard(self) -> None:
        """Delete the staged copy, if any (the published folder is never touched)."""
        if self.load_from != self.folder:
            shutil.rmtree(self.load_from, ignore_errors=True)


def _names(folder: Path, version: int) -> list[str]:
    """The files to read: those the manifest lists (and the manifest), else every file of the folder."""
    manifest = manifest_of(folder, version)
    if manifest is None:
        return sorted(p.name for p in folder.iterdir() if p.is_file())
    return [*sorted(manifest["files"]), MANIFEST]


def _stage(config: ReloadConfig, version: int, size: int) -> Path | None:
    """A fresh staging folder for `size` bytes under `prefetch_dir`, or None (logged) when over the bound."""
    root = Path(config.prefetch_dir)
    if size > config.prefetch_max_bytes:
        log.info(
            "v%d is %.2f GB > reload.prefetch_max_bytes %.2f GB: prefetching into the page cache instead",
            version, size / 1e9, config.prefetch_max_bytes / 1e9,
        )  # fmt: skip
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
        if free < size:
            log.warning(
                "%s has %.2f GB free, v%d needs %.2f GB: prefetching into the page cache instead",
                root, free / 1e9, version, size / 1e9,
            )  # fmt: skip
            return None
        stage = root / f"offpolicy-{os.getpid()}-v{version}"
        shutil.rmtree(stage, ignore_errors=True)  # a copy left by an interrupted prefetch of this process
        stage.mkdir()
    except OSError as e:
        log.warning(
            "cannot stage v%d under %s (%s): prefetching into the page cache instead", version, root, e
        )
        return None
    return stage


def _read(
    path: Path, hashing: bool, copy_to: Path | None, buf: bytearray, cancel: threading.Event | None
) -> str | None:
    """Read `path` once, start to end; hash it (its hex sha256) and copy it to `copy_to` on the way."""
    digest = hashlib.sha256() if hashing else None
    view = memoryview(buf)
    with path.open("rb", buffering=0) as src, copy_to.open("wb") if copy_to else nullcontext() as dst:
        while n := src.readinto(buf):
            if cancel is not None and cancel.is_set():
                raise Cancelled(str(path))
            if digest is not None:
                digest.update(view[:n])
            if dst is not None:
                dst.write(view[:n])
    return None if digest is None else digest.hexdigest()


def prefetch_folder(
    folder: Path,
    record_sha256: str,
    version: int,
    config: ReloadConfig,
    cancel: threading.Event | None = None,
) -> Prefetched:
    """Verify `folder` for the record (`config.verify`) and read it ahead (`config.prefetch`).

    Raises `WeightLoadError` (`checksum` or `missing`) as `verify_folder` does, or `Cancelled` once `cancel`
    is set (checked at each chunk read); no staged copy is left then.
    """
    t0 = time.perf_counter()
    has_manifest = (folder / MANIFEST).is_file()
    hashing = config.verify == "full" or (config.verify == "manifest" and not has_manifest)
    if not hashing or config.prefetch == "none":
        verify_folder(folder, record_sha256, version, config.verify)  # hashes here only without a prefetch
    if config.prefetch == "none":
        return Prefetched(version, folder, folder, "none", 0, time.perf_counter() - t0)
    names = _names(folder, version)
    size = sum((folder / n).stat().st_size for n in names if (folder / n).is_file())
    stage = _stage(config, version, size) if config.prefetch == "memory" else None
    digests: dict[str, str] = {}
    buf = bytearray(_CHUNK)
    try:
        for name in names:
            if not (folder / name).is_file():
                continue  # verify_folder names what is missing
            digest = _read(folder / name, hashing, stage / name if stage else None, buf, cancel)
            if digest is not None:
                digests[name] = digest
        if hashing:
            verify_folder(folder, record_sha256, version, config.verify, digests)
    except BaseException:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    where = "memory" if stage is not None else "page_cache"
    return Prefetched(version, folder, stage or folder, where, size, time.perf_counter() - t0)
