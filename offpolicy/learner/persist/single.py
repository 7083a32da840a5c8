"""Checkpoints of a one-process learner: whole tensors in safetensors, written by the background writer.

A checkpoint folder (`FILE_FORMAT`) holds `model.safetensors` (under LoRA the adapter's tensors alone;
+ `critic.safetensors`),
`optimizer.safetensors` (+ `critic_optimizer.safetensors`: AdamW moments flattened as `state.<i>.<name>`),
`rng.safetensors` (torch CPU / CUDA generator states) and `meta.json`.

`snapshot_checkpoint` copies all of it to host memory at a step boundary (the critical-path part, overlapping
the next step's passes until `staged()`); `write_checkpoint` writes it on the background writer into a
temporary folder, fsyncs and renames it. `FileCheckpoints` is the backend; it also reads a sharded
checkpoint (any world size wrote it) into the one process.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from offpolicy.learner.distributed.ranks import SINGLE
from offpolicy.learner.errors import CheckpointMismatch
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.persist import dcp
from offpolicy.learner.persist.checkpoint import (
    FILE_FORMAT,
    SHARDED_FORMAT,
    Checkpoints,
    NoCheckpoints,
    checkpoint_versions,
    latest_checkpoint,
    read_meta,
    restore_rngs,
    rng_state,
    saved_names,
)
from offpolicy.learner.persist.file_generation import HostCopy
from offpolicy.learner.persist.version_folders import remove_folder
from offpolicy.learner.persist.writer import BackgroundWriter
from offpolicy.weights.safetensors_io import write_safetensors

if TYPE_CHECKING:
    from offpolicy.learner.build import Trainables
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.distributed.ranks import Ranks


class FileCheckpoints(Checkpoints):
    """The checkpoints of a one-process learner under `root`, written by `writer` (durability is reported
    by the writer's `on_done`, kind `checkpoint`), the newest `keep` kept."""

    def __init__(self, root: Path, run_id: str, writer: BackgroundWriter, keep: int | None) -> None:
        self.root, self.run_id, self.writer, self.keep = root, run_id, writer, keep
        self._snapshots: list[CheckpointSnapshot] = []
        self._nbytes = 0

    def save(self, parts: Trainables, version: int, meta: dict[str, Any]) -> Path:
        snap = snapshot_checkpoint(parts, meta)
        self._snapshots.append(snap)
        self._nbytes = sum(t.nbytes for c in snap.copies.values() for t in c.tensors.values())
        root, keep = self.root, self.keep
        self.writer.submit("checkpoint", version, lambda: write_checkpoint(root, snap, keep))
        return root / f"ckpt-{version:010d}"

    def staged(self) -> None:
        for snap in self._snapshots:
            snap.wait()
        self._snapshots.clear()

    def finish(self) -> None:
        self.writer.flush(kind="checkpoint")

    def close(self) -> None:
        """Nothing of its own: the writer's `close` finishes (or, on a full disk, drops) the queued write."""

    def pending(self) -> bool:
        return self.writer.pending("checkpoint")

    def snapshot_bytes(self) -> int | None:
        return self._nbytes

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def load(self, path: Path, parts: Trainables) -> dict[str, Any]:
        meta = read_meta(path, parts, self.run_id)
        if meta["format"] == SHARDED_FORMAT:
            return dcp.load_sharded(path, parts, SINGLE)  # whatever world size wrote it
        return load_checkpoint(path, parts, self.run_id)


# --- snapshot and write


def _optimizer_to_files(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            key = f"state.{idx}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach()  # copied to the host by the snapshot's HostCopy
            else:
                scalars[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_files(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


@dataclass(frozen=True, slots=True)
class CheckpointSnapshot:
    """A checkpoint taken at a step boundary: its tensors are being copied to host memory (`copies`, the
    learner waits for them before the next optimizer step); `write_checkpoint` writes it (background)."""

    version: int
    copies: dict[str, HostCopy]  # file name (without .safetensors) -> its tensors' host copy
    meta: dict[str, Any]

    def wait(self) -> None:
        """Block until every tensor is in host memory."""
        for copy in self.copies.values():
            copy.wait()


def _host(tensors: dict[str, torch.Tensor]) -> HostCopy:
    """A background host copy of `tensors` into pageable memory (a checkpoint's optimizer state is ~3x the
    weights: too much to keep pinned between checkpoints)."""
    return HostCopy(tensors, None, pin=False)


def snapshot_checkpoint(parts: Trainables, meta: dict[str, Any]) -> CheckpointSnapshot:
    """Copy everything a checkpoint holds to host memory (the critical-path part of a checkpoint); `meta`
    is `base_meta(...)`."""
    saved = saved_names(parts.model)  # under LoRA the adapter alone
    files = {"model": _host({k: v for k, v in unique_state(parts.model).items() if saved(k)})}
    opt_tensors, opt_meta = _optimizer_to_files(parts.optimizer)
    files["optimizer"] = _host(opt_tensors)
    meta = meta | {"format": FILE_FORMAT, "optimizer": opt_meta}
    if parts.critic is not None and parts.critic_optimizer is not None:
        files["critic"] = _host(unique_state(parts.critic))
        c_tensors, meta["critic_optimizer"] = _optimizer_to_files(parts.critic_optimizer)
        files["critic_optimizer"] = _host(c_tensors)
    files["rng"] = _host(rng_state())
    return CheckpointSnapshot(int(meta["version"]), files, meta)


def write_checkpoint(checkpoint_dir: str | Path, snap: CheckpointSnapshot, keep: int | None = None) -> Path:
    """Write `ckpt-<version>/` atomically (temp folder, fsync, rename); keep the newest `keep`. A write
    that fails (a full disk) removes its temporary folder at once, then raises."""
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        for name, copy in snap.copies.items():
            write_safetensors(tmp / f"{name}.safetensors", copy.wait())  # fsynced
        (tmp / "meta.json").write_text(json.dumps(snap.meta, indent=1))
        with (tmp / "meta.json").open("rb") as fh:
            os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took is back now, not at the next start
        raise
    final = root / f"ckpt-{snap.version:010d}"
    if final.exists():
        remove_folder(final)
    tmp.rename(final)
    if keep is not None:
        for v in checkpoint_versions(root)[:-keep]:
            remove_folder(root / f"ckpt-{v:010d}")
    return final


# --- read back


def _load_module(module: torch.nn.Module, file: Path, device: torch.device) -> None:
    """Load a module's tensors; only the second names of tied tensors may be absent from the file, and
    under LoRA the frozen base's (`saved_names`: reloaded from `model_path`, never checkpointed)."""
    state = load_file(str(file), device=str(device))
    missing, unexpected = module.load_state_dict(state, strict=False)
    names, saved = set(module.state_dict()), saved_names(module)
    absent = (names - set(unique_state(module))) | {k for k in names if not saved(k)}
    if unexpected or set(missing) - absent:
        raise CheckpointMismatch(f"{file}: missing {sorted(set(missing) - absent)}, unexpected {unexpected}")


def load_checkpoint(path: str | Path, parts: Trainables, run_id: str = "default") -> dict[str, Any]:
    """Restore `parts` and the RNGs from the one-process checkpoint folder `path`; return its meta.

    Raises `CheckpointMismatch` when the checkpoint belongs to another run or another model."""
    path = Path(path)
    meta = read_meta(path, parts, run_id)
    if meta["format"] != FILE_FORMAT:
        raise CheckpointMismatch(f"{path} is sharded (format {SHARDED_FORMAT}): persist/dcp.py reads it")
    device = next(parts.model.parameters()).device
    _load_module(parts.model, path / "model.safetensors", device)
    _optimizer_from_files(parts.optimizer, load_file(str(path / "optimizer.safetensors")), meta["optimizer"])
    parts.scheduler.load_state_dict(meta["scheduler"])
    if parts.critic is not None and parts.critic_optimizer is not None:
        _load_module(parts.critic, path / "critic.safetensors", device)
        c_tensors = load_file(str(path / "critic_optimizer.safetensors"))
        _optimizer_from_files(parts.critic_optimizer, c_tensors, meta["critic_optimizer"])
    restore_rngs(path, meta)
    return meta


def make_checkpoints(
    config: LearnerConfig,
    ranks: Ranks,
    writer: BackgroundWriter,
    on_durable: Callable[[int, float], None],
    on_failed: Callable[[int, OSError], None] | None = None,
) -> Checkpoints:
    """The checkpoint backend of this learner: none (disabled), sharded (N ranks) or files (one process)."""
    root = config.checkpoint_path
    keep = config.checkpoint.keep_checkpoints
    if root is None:
        return NoCheckpoints()
    if ranks.distributed:
        return dcp.ShardedCheckpoints(
            root, config.run_id, ranks, keep, on_durable, config.checkpoint.async_staging, on_failed
        )
    return FileCheckpoints(root, config.run_id, writer, keep)
