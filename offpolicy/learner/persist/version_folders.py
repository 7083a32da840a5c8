"""The version folders on the weights volume: their names, which exist, removal that a kill -9 cannot
leave half done, and pruning that keeps what an actor may still need (a delta version's chain).

`v<version>/` under the learner's `publish.weights_dir` (persist/file_generation.py writes them); hidden
`.tmp-` and `.old-` folders are a write or a removal under way, or what a killed learner left.
"""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

from offpolicy.weights.delta import manifest_base

VERSION_DIR = re.compile(r"^v(\d+)$")


def version_dir(weights_dir: str | Path, version: int) -> Path:
    """`<weights_dir>/v<version>`."""
    return Path(weights_dir) / f"v{version}"


def published_versions(weights_dir: str | Path) -> list[int]:
    """Versions present under `weights_dir`, ascending (temporary folders are not versions)."""
    root = Path(weights_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := VERSION_DIR.match(p.name)))


def remove_leftovers(folder: str | Path) -> list[str]:
    """Delete the hidden temporary folders a killed writer left under `folder`; return their names."""
    root = Path(folder)
    if not root.is_dir():
        return []
    doomed = [p for p in root.iterdir() if p.is_dir() and p.name.startswith((".tmp-", ".old-"))]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in doomed]


def remove_folder(path: Path) -> None:
    """Delete a visible folder so that a kill -9 midway never leaves a half-deleted one under its name:
    renamed to a hidden `.old-` name first (atomic), then deleted (`remove_leftovers` finishes the job
    after a crash)."""
    trash = path.parent / f".old-{path.name}-{uuid.uuid4().hex}"
    path.rename(trash)
    shutil.rmtree(trash)


def prune_versions(weights_dir: str | Path, keep: int, protect: int | None = None) -> list[int]:
    """Delete all but the newest `keep` version folders (never `protect`, nor the newest full version and
    the delta versions after it: the chain an actor that is behind or restarting loads); return the
    deleted versions."""
    versions = published_versions(weights_dir)
    root = next(
        (v for v in reversed(versions) if _is_full(version_dir(weights_dir, v))), None
    )  # the newest full version: it and every delta after it stay
    doomed = [v for v in versions[:-keep] if v != protect and (root is None or v < root)] if keep > 0 else []
    for v in doomed:
        remove_folder(version_dir(weights_dir, v))
    return doomed


def _is_full(folder: Path) -> bool:
    """A version folder that is not a delta (its manifest names no base; a folder without one counts)."""
    try:
        return manifest_base(folder) is None
    except (OSError, ValueError):
        return False
