"""Check a published weights folder before loading it: against its `manifest.json`, a full re-hash, or not.

The learner writes into each published folder `v<version>/` a `manifest.json`:

    {"format": 2, "version": <int>, "sha256": <the policy record's checksum>,
     "files": {"<name>": {"bytes": <int>, "sha256": "<hex>"}, ...}}

covering every file of the folder, where `sha256` is `buffer.policy.weights_sha256` of the folder (one
`*.safetensors`: its sha256; shards: the sha256 of their `sha256sum` listing). `verify="manifest"` trusts
the learner's hashes: the manifest must name the record's checksum and every listed file must exist with
its listed size (no hashing, so a reload costs no second read of the weights). `full` re-hashes each file
once (against the manifest when there is one; the shards' digests combined against the record's checksum).
A folder without a manifest under `manifest` falls back to `full`, logged. A format-1 manifest (an older
learner's, whose sharded checksum was the sha256 of the shards' concatenation) is read the same way; under
`full` its shards are checked against their manifest digests, and the manifest against the record.
`write_manifest` is the format's reference writer (tests; the learner's background writer writes the same).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actors.errors import WeightLoadError
from buffer.policy import combine_sha256, file_sha256

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
FORMAT = 2
LEGACY_FORMAT = 1  # an older learner's: the same per-file entries, shards' `sha256` defined otherwise


def write_manifest(folder: str | Path, version: int) -> Path:
    """Write `folder/manifest.json` for the files now in `folder` (every file but the manifest)."""
    root = Path(folder)
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(root.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    shards = [(name, f["sha256"]) for name, f in files.items() if name.endswith(".safetensors")]
    doc = {"format": FORMAT, "version": version, "sha256": combine_sha256(shards), "files": files}
    out = root / MANIFEST
    out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    return out


def read_manifest(folder: Path, version: int) -> dict[str, Any] | None:
    """The folder's manifest, or None when it has none; `WeightLoadError("checksum")` when malformed."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        ok = (
            doc["format"] in (LEGACY_FORMAT, FORMAT)
            and isinstance(doc["sha256"], str)
            and all(
                isinstance(f["bytes"], int) and isinstance(f["sha256"], str) for f in doc["files"].values()
            )
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightLoadError(version, "checksum", f"{path} is not a manifest: {e!r}") from e
    if not ok:
        raise WeightLoadError(version, "checksum", f"{path}: unknown format or malformed entries")
    return doc


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
    manifest = read_manifest(folder, version)
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
