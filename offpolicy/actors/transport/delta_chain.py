"""Delta versions on the actor: the full version a delta folder stands for, built on a local copy.

A delta version (weights/delta.py) names its base version; the engine loads full folders. `DeltaChain`
builds the full folder of a delta version under `reload.delta_dir` while the engine generates (before
the pause, as a prefetch):

1. The chain: from the target back through each delta's base until a version it can start from: its own
   copy of that version (the one the engine holds, built last time) or a full published folder (an actor
   that is behind, restarting, or whose copy is gone starts from the newest full version; the learner
   keeps it and every delta after it). A missing link, or more than `MAX_CHAIN` links, fails (`missing`).
2. Every delta folder of the chain is checked against its manifest (sizes and sha256 of its files) and
   the target's against the policy record.
3. Tensor by tensor, in the file order of the target: read from the start version, each link applied in
   turn, and after each the tensor's sha256 checked against that link's `delta.json`; a mismatch (a corrupt
   or stale delta, a wrong base) fails the version (`checksum`), counted by `reload_failures`; the actor
   stays on what it holds, and the next full version heals it (at most `publish.full_every` later).
4. The tensors are written as safetensors with their manifest into a hidden folder, renamed to
   `v<version>` when complete: the engine never sees half a version.

The copy of the loaded version stays (the base of the next delta, and what a failed load restores);
the others are deleted once a version is loaded (`keep_only`). The disk it needs: two full versions.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from offpolicy.actors.errors import WeightLoadError
from offpolicy.actors.transport.prefetch import Cancelled, Prefetched
from offpolicy.actors.transport.verify import manifest_of, verify_folder
from offpolicy.weights.delta import (
    DELTA_INDEX,
    DELTA_WEIGHTS,
    DTYPES,
    DeltaIndex,
    DeltaMismatch,
    apply,
    payloads,
    tensor_sha256,
)
from offpolicy.weights.manifest import MANIFEST, encode_manifest, manifest_doc
from offpolicy.weights.safetensors_io import fsync_dir, write_small, write_weight_files

log = logging.getLogger(__name__)

MAX_CHAIN = 256
"""Most deltas applied for one version (`publish.full_every` bounds a chain to fewer)."""
SHARD_BYTES = 5 * 2**30
BUILDERS = max(1, min(8, (os.cpu_count() or 2) // 2))
"""Threads applying and hashing tensors while the writer writes the ones before (numpy, zstd and hashlib
release the GIL); at most twice as many tensors in flight."""
_DELTA_FILES = (DELTA_WEIGHTS, DELTA_INDEX, MANIFEST)


def is_delta(folder: Path, version: int) -> bool:
    """Whether a published folder is a delta version (its manifest names a base)."""
    doc = manifest_of(folder, version)
    return doc is not None and doc.get("base") is not None


class DeltaChain:
    """The full folders this actor built from delta versions, under `root` (module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root) / f"offpolicy-{os.getpid()}"
        self.built = 0  # versions built
        self.applied = 0  # deltas applied
        self.removed = _remove_dead(Path(root))  # what killed actors left (their folders, half-built ones)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def keep_only(self, loaded: str | Path | None) -> None:
        """Delete every built version but the folder the engine holds (`loaded`)."""
        if not self.root.is_dir():
            return
        keep = Path(loaded).resolve() if loaded else None
        for p in self.root.iterdir():
            if p.resolve() != keep:
                shutil.rmtree(p, ignore_errors=True)

    def _chain(self, folder: Path, version: int) -> tuple[Path, list[tuple[int, Path]]]:
        """(the folder to start from, the delta links to apply in order)."""
        links: list[tuple[int, Path]] = []
        cur, at = folder, version
        while True:
            doc = manifest_of(cur, at)
            if doc is None:
                raise WeightLoadError(version, "missing", f"{cur} has no manifest: not a published version")
            base = doc.get("base")
            if base is None:
                return cur, links[::-1]
            links.append((at, cur))
            if len(links) > MAX_CHAIN:
                raise WeightLoadError(
                    version, "missing", f"delta chain of v{version} longer than {MAX_CHAIN}"
                )
            if (self.path(base) / MANIFEST).is_file():
                return self.path(base), links[::-1]
            at, cur = int(base), cur.parent / f"v{base}"
            if not cur.is_dir():
                raise WeightLoadError(
                    version, "missing", f"delta chain of v{version}: base v{at} is gone from {cur.parent}"
                )

    def build(
        self, folder: Path, record_sha256: str, version: int, cancel: threading.Event | None = None
    ) -> Prefetched:
        """The full folder of delta version `version` (published at `folder`), built and verified."""
        t0 = time.perf_counter()
        start, links = self._chain(folder, version)
        read = 0
        steps: list[tuple[int, dict[str, dict[str, Any]], Any]] = []
        for v, link in links:
            doc = manifest_of(link, v)
            sha = record_sha256 if v == version else doc["sha256"]
            verify_folder(link, sha, v, "full")
            try:
                index = DeltaIndex.read(link)
                steps.append((v, {t["name"]: t for t in index.tensors}, payloads(link)))
            except DeltaMismatch as e:
                raise WeightLoadError(version, "checksum", f"v{v}: {e}") from e
            read += sum(f["bytes"] for f in doc["files"].values())
        # the target is the chain's last link: its index lists every tensor, in file order
        entries = [(t["name"], tuple(t["shape"]), DTYPES[t["dtype"]]) for t in steps[-1][1].values()]
        sources = _tensor_files(start)
        missing = [name for name, _, _ in entries if name not in sources]
        if missing:
            raise WeightLoadError(
                version, "checksum", f"{start} lacks {len(missing)} tensor(s): {missing[0]!r}"
            )

        def make(entry: tuple[str, tuple[int, ...], torch.dtype]) -> torch.Tensor:
            if cancel is not None and cancel.is_set():
                raise Cancelled(str(folder))
            name = entry[0]
            with safe_open(str(sources[name]), framework="pt") as fh:
                t = fh.get_tensor(name)
            for v, index, blobs in steps:
                e = index.get(name)
                if e is None:
                    raise WeightLoadError(version, "checksum", f"v{v}'s delta has no entry for {name!r}")
                try:
                    t = apply(t, e["encoding"], e["changed"], blobs.get(name, b""))
                except DeltaMismatch as err:
                    raise WeightLoadError(version, "checksum", f"v{v}, {name}: {err}") from err
                if tensor_sha256(t) != e["sha256"]:
                    raise WeightLoadError(
                        version, "checksum", f"{name} after applying v{v}'s delta does not match its sha256"
                    )
            return t

        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-v{version}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            with ThreadPoolExecutor(BUILDERS, thread_name_prefix="offpolicy-delta") as pool:
                files = write_weight_files(tmp, entries, _ahead(pool, make, entries), SHARD_BYTES)
            for p in sorted(folder.iterdir()):
                if p.is_file() and p.name not in _DELTA_FILES:  # config.json, the tokenizer's files
                    files[p.name] = write_small(tmp / p.name, p.read_bytes())
            write_small(tmp / MANIFEST, encode_manifest(manifest_doc(version, files)))
            fsync_dir(tmp)
            final = self.path(version)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.built += 1
        self.applied += len(steps)
        log.info(
            "v%d built from %s and %d delta(s) (%.1f MB read) in %.2f s",
            version, start, len(steps), read / 1e6, time.perf_counter() - t0,
        )  # fmt: skip
        return Prefetched(version, final, final, "delta", read, time.perf_counter() - t0)


def _ahead(pool: ThreadPoolExecutor, make: Callable, entries: list) -> Callable:
    """`take` for the writer: each entry's tensor made on `pool`, at most 2 x `BUILDERS` ahead of it."""
    jobs: collections.deque[tuple[str, Future]] = collections.deque()
    queued = iter(entries)

    def take(entry: tuple[str, tuple[int, ...], torch.dtype]) -> torch.Tensor:
        while len(jobs) < 2 * BUILDERS and (nxt := next(queued, None)) is not None:
            jobs.append((nxt[0], pool.submit(make, nxt)))
        name, job = jobs.popleft()
        assert name == entry[0], (name, entry[0])  # the writer takes them in order
        return job.result()

    return take


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Which `*.safetensors` file of `folder` holds each tensor."""
    out: dict[str, Path] = {}
    for p in sorted(folder.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as fh:
            out.update(dict.fromkeys(fh.keys(), p))
    return out


def _remove_dead(root: Path) -> list[str]:
    """Delete the folders of actors no longer running under `root` (`offpolicy-<pid>` whose process is
    gone: a killed or restarted actor's built versions, a half-built one included); their names."""
    gone = []
    for p in root.glob("offpolicy-*") if root.is_dir() else ():
        try:
            pid = int(p.name.removeprefix("offpolicy-"))
        except ValueError:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p.name)
    if gone:
        log.info("removed %d delta folder(s) of actors no longer running under %s", len(gone), root)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
