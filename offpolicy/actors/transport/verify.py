"""Check a published weights folder before loading it: against its `manifest.json`, a full re-hash, or not.

The format (`offpolicy/weights/manifest.py`, its one writer and reader) lists every file of the folder
with its size and sha256, and the policy record's checksum. `verify="manifest"` trusts
the learner's hashes: the manifest must name the record's checksum and every listed file must exist with
its listed size (no hashing, so a reload costs no second read of the weights). `full` re-hashes each file
once (against the manifest when there is one; the shards' digests combined against the record's checksum).
A folder without a manifest under `manifest` falls back to `full`, logged. A format-1 manifest's shards
are checked under `full` against their manifest digests, and the manifest against the record.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offpolicy.actors.errors import WeightLoadError
from offpolicy.weights.manifest import (
    LEGACY_FORMAT,
    MANIFEST,
    MalformedManifest,
    combine_sha256,
    file_sha256,
    read_manifest,
)

log = logging.getLogger(__name__)


def manifest_of(folder: Path, version: int) -> dict[str, Any] | None:
    """The folder's manifest (None when it has none); a malformed one is `WeightLoadError("checksum")`."""
    try:
        return read_manifest(folder)
    except MalformedManifest as e:
        raise WeightLoadError(version, "checksum", str(e)) from e


def _check_sizes(folder: Path, manifest: dict[str, Any], version: int) -> None:
    for name, entry in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise WeightLoadError(version, "missing", f"{path} is listed in the manifest but absent")
        if path.stat().st_size != entry["bytes"]:
            raise WeightLoadError(
                version,
                "checksum",
                f"{path} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}",
            )


def verify_folder(
    folder: Path, record_sha256: str, version: int, mode: str, digests: Mapping[str, str] | None = None
) -> str:
    """Check `folder` for the record (`mode`: manifest | full | none); return the check really made.

    `digests`: files' sha256 already computed while reading them (the prefetch), by name; `full` hashes
    only the files missing from it. Raises `WeightLoadError` with reason `checksum` (a hash, size or
    manifest mismatch) or `missing`.
    """
    if mode == "none":
        return "none"
    manifest = manifest_of(folder, version)
    if mode == "manifest" and manifest is None:
        log.warning("%s has no %s: verifying v%d by re-hashing the folder", folder, MANIFEST, version)
    if manifest is not None:
        if manifest["sha256"] != record_sha256:
            raise WeightLoadError(
                version,
                "checksum",
                f"{folder}/{MANIFEST} says sha256 {manifest['sha256']}, the record {record_sha256}",
            )
        _check_sizes(folder, manifest, version)
        if mode == "manifest":
            return "manifest"
    digests = dict(digests or {})
    names = manifest["files"] if manifest is not None else [p.name for p in folder.glob("*.safetensors")]
    for name in names:
        if name not in digests:
            digests[name] = file_sha256(folder / name)  # each byte is hashed once
        if manifest is not None and digests[name] != manifest["files"][name]["sha256"]:
            raise WeightLoadError(
                version,
                "checksum",
                f"sha256 of {folder / name} is {digests[name]}, the manifest says "
                f"{manifest['files'][name]['sha256']}",
            )
    shards = [(n, digests[n]) for n in sorted(names) if n.endswith(".safetensors")]
    if manifest is not None and manifest["format"] == LEGACY_FORMAT and len(shards) > 1:
        return "full"  # every file matched its manifest digest, and the manifest names the record's sha256
    got = combine_sha256(shards)
    if got != record_sha256:
        raise WeightLoadError(
            version, "checksum", f"sha256 of {folder} is {got}, the record says {record_sha256}"
        )
    return "full"
