"""Publish the policy's weights for the actors: `v<version>/` written whole or not at all, then announced.

A version folder holds `model*.safetensors` (+ index when sharded), `config.json`, `generation_config.json`
and the tokenizer files: what `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and vLLM's
`collective_rpc("reload_weights", kwargs={"weights_path": DIR})` read. It is written into a hidden temporary
folder beside it and renamed into place, so a reader never sees half a version. `weights_uri` in the
policy record is the folder's absolute path.
"""

from __future__ import annotations

import re
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from buffer.policy import PolicyRecord, weights_sha256

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from buffer.policy import PolicyStore

VERSION_DIR = re.compile(r"^v(\d+)$")


def version_dir(weights_dir: str | Path, version: int) -> Path:
    """`<weights_dir>/v<version>`."""
    return Path(weights_dir) / f"v{version}"


safetensors_sha256 = weights_sha256
"""The policy record's checksum of a weights folder (`buffer.policy.weights_sha256`), under its old name."""


def published_versions(weights_dir: str | Path) -> list[int]:
    """Versions present under `weights_dir`, ascending (temporary folders are not versions)."""
    root = Path(weights_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := VERSION_DIR.match(p.name)))


def write_version(
    model: PreTrainedModel,
    weights_dir: str | Path,
    version: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[Path, str]:
    """Write `v<version>/` atomically (temp folder + rename); return (folder, sha256 of its safetensors).

    An existing `v<version>/` (a resumed learner re-publishing a version) is replaced as a whole.
    """
    final = version_dir(weights_dir, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-v{version}-{uuid.uuid4().hex}"
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    sha = weights_sha256(tmp)
    if final.exists():
        trash = final.parent / f".old-v{version}-{uuid.uuid4().hex}"
        final.rename(trash)
        shutil.rmtree(trash)
    tmp.rename(final)
    return final, sha


def prune_versions(weights_dir: str | Path, keep: int, protect: int | None = None) -> list[int]:
    """Delete all but the newest `keep` version folders (never `protect`); return the deleted versions."""
    versions = published_versions(weights_dir)
    doomed = [v for v in versions[:-keep] if v != protect] if keep > 0 else []
    for v in doomed:
        shutil.rmtree(version_dir(weights_dir, v))
    return doomed


def publish_weights(
    model: PreTrainedModel,
    weights_dir: str | Path,
    version: int,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    store: PolicyStore | None = None,
    keep_versions: int | None = None,
) -> PolicyRecord:
    """Write `v<version>/`, then SET + announce the policy record in `store`, then prune old versions."""
    folder, sha = write_version(model, weights_dir, version, tokenizer)
    record = PolicyRecord(
        version=version, weights_uri=str(folder.resolve()), sha256=sha, published_at=time.time()
    )
    if store is not None:
        store.publish(record)
    if keep_versions is not None:
        prune_versions(weights_dir, keep_versions, protect=version)
    return record
