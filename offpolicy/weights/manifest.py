"""The published folder's manifest and checksums: the one writer and the one reader of `manifest.json`.

The learner writes into each published folder `v<version>/` a `manifest.json`:

    {"format": 2, "version": <int>, "sha256": <the policy record's checksum>,
     "files": {"<name>": {"bytes": <int>, "sha256": "<hex>"}, ...}}

covering every file of the folder but itself. `sha256` is `weights_sha256` of the folder: one
`*.safetensors` file: its own sha256; shards: the sha256 of their `sha256sum` listing (`combine_sha256`).
A format-1 manifest (an older learner's, whose sharded checksum was the sha256 of the shards' concatenation)
has the same per-file entries and is read the same way. The learner builds the document with `manifest_doc`
from the digests it computed while writing; the actors read it with `read_manifest`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 2
LEGACY_FORMAT = 1  # an older learner's: the same per-file entries, shards' `sha256` defined otherwise
_CHUNK = 1 << 20  # bytes read at a time while hashing weights


class MalformedManifest(ValueError):
    """A `manifest.json` that is not JSON, has an unknown format or malformed entries."""


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def combine_sha256(digests: Sequence[tuple[str, str]]) -> str:
    """`PolicyRecord.sha256` from the `*.safetensors` files' own digests `[(name, hex), ...]` in name order:
    one file: its own sha256; several (shards): the sha256 of their `sha256sum` listing, one line
    `"<hex>  <name>\\n"` per file (`sha256sum model-*.safetensors | sha256sum`). Each byte of the weights
    is hashed once, by its own file's digest, which the manifest lists too."""
    if len(digests) == 1:
        return digests[0][1]
    listing = "".join(f"{hex_}  {name}\n" for name, hex_ in digests)
    return hashlib.sha256(listing.encode()).hexdigest()


def weights_sha256(folder: str | Path) -> str:
    """`PolicyRecord.sha256` of a published weights folder (`combine_sha256` over its `*.safetensors` in name
    order); the learner computes it while writing, the actors check it."""
    files = sorted(Path(folder).glob("*.safetensors"))
    return combine_sha256([(p.name, file_sha256(p)) for p in files])


def manifest_doc(version: int, files: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The manifest of `version` for `files` (name -> {"bytes", "sha256"}, every file of the folder but the
    manifest); its `sha256` is combined from the `*.safetensors` entries in name order."""
    entries = {name: {"bytes": f["bytes"], "sha256": f["sha256"]} for name, f in sorted(files.items())}
    shards = [(name, f["sha256"]) for name, f in entries.items() if name.endswith(".safetensors")]
    return {"format": FORMAT, "version": version, "sha256": combine_sha256(shards), "files": entries}


def encode_manifest(doc: Mapping[str, Any]) -> bytes:
    """The manifest's bytes as the learner writes them."""
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def write_manifest(folder: str | Path, version: int) -> Path:
    """Hash every file now in `folder` (but the manifest) and write `folder/manifest.json`: for folders
    written elsewhere (tests, tools); the learner's writer hashes while writing and uses `manifest_doc`."""
    root = Path(folder)
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(root.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    out = root / MANIFEST
    out.write_bytes(encode_manifest(manifest_doc(version, files)))
    return out


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The folder's manifest, or None when it has none; `MalformedManifest` when it is not one."""
    path = Path(folder) / MANIFEST
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
        raise MalformedManifest(f"{path} is not a manifest: {e!r}") from e
    if not ok:
        raise MalformedManifest(f"{path}: unknown format or malformed entries")
    return doc
