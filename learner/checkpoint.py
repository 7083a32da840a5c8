"""Resumable learner checkpoints: tensors in safetensors, everything else in JSON, written atomically.

A checkpoint is a folder `ckpt-<version>/` holding `model.safetensors` (+ `critic.safetensors`),
`optimizer.safetensors` (+ `critic_optimizer.safetensors`: AdamW moments flattened as `state.<i>.<name>`),
`rng.safetensors` (torch CPU / CUDA generator states) and `meta.json` (version, step, config, buffer
position, optimizer param groups, scheduler state, Python RNG, and the identity it was written for: run id
and model fingerprint). No pickle anywhere.

`snapshot_checkpoint` copies all of it to host memory at a step boundary (the critical-path part);
`write_checkpoint` writes it on the background writer (learner/writer.py) into a temporary folder, fsyncs
and renames it, so a learner killed mid-write leaves the previous checkpoint intact and the leftover
temporary folder is never resumed. A checkpoint of another run or model is refused (`CheckpointMismatch`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from learner.errors import CheckpointMismatch
from learner.weights import HostCopy, remove_folder, unique_state, write_safetensors

FORMAT = 2
CKPT_DIR = re.compile(r"^ckpt-(\d+)$")


@dataclass(slots=True)
class Trainables:
    """The stateful objects a checkpoint saves and restores (critic ones are None without GAE)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    policy: torch.nn.Module | None = None  # what the loop calls for log-probs (`sharding.LogProbs` of model)


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


def checkpoint_versions(checkpoint_dir: str | Path) -> list[int]:
    """Versions of the complete checkpoints under `checkpoint_dir`, ascending."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := CKPT_DIR.match(p.name)))


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    versions = checkpoint_versions(checkpoint_dir)
    return Path(checkpoint_dir) / f"ckpt-{versions[-1]:010d}" if versions else None


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


def identity(parts: Trainables, run_id: str) -> dict[str, str]:
    """What a checkpoint must match to be resumed: the run id and a fingerprint of the model's tensors
    (names, shapes and dtypes of its state dict), so another run's or another model's is refused."""
    spec = [(k, list(v.shape), str(v.dtype)) for k, v in parts.model.state_dict().items()]
    return {"run_id": run_id, "model": hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]}


def _host(tensors: dict[str, torch.Tensor]) -> HostCopy:
    """A background host copy of `tensors` into pageable memory (a checkpoint's optimizer state is ~3x the
    weights: too much to keep pinned between checkpoints)."""
    return HostCopy(tensors, None, pin=False)


def base_meta(
    parts: Trainables,
    *,
    version: int,
    step: int,
    run_id: str,
    config: dict[str, Any],
    buffer_position: dict[str, Any],
    lease_ids: list[str] | None = None,
) -> dict[str, Any]:
    """What every checkpoint's `meta.json` holds, whatever its layout: identity, counters, config, buffer
    position, the leases it holds, the scheduler and the Python RNG."""
    return {
        "identity": identity(parts, run_id),
        "version": version,
        "step": step,
        "saved_at": time.time(),
        "config": config,
        "buffer_position": buffer_position,
        "lease_ids": list(lease_ids or []),
        "scheduler": parts.scheduler.state_dict(),
        "python_rng": random.getstate(),
    }


def snapshot_checkpoint(parts: Trainables, meta: dict[str, Any]) -> CheckpointSnapshot:
    """Copy everything a checkpoint holds to host memory (the critical-path part of a checkpoint); `meta`
    is `base_meta(...)`."""
    files = {"model": _host(unique_state(parts.model))}
    opt_tensors, opt_meta = _optimizer_to_files(parts.optimizer)
    files["optimizer"] = _host(opt_tensors)
    meta = meta | {"format": FORMAT, "optimizer": opt_meta}
    if parts.critic is not None and parts.critic_optimizer is not None:
        files["critic"] = _host(unique_state(parts.critic))
        c_tensors, meta["critic_optimizer"] = _optimizer_to_files(parts.critic_optimizer)
        files["critic_optimizer"] = _host(c_tensors)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng |= {f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    files["rng"] = _host(rng)
    return CheckpointSnapshot(int(meta["version"]), files, meta)


def write_checkpoint(checkpoint_dir: str | Path, snap: CheckpointSnapshot, keep: int | None = None) -> Path:
    """Write `ckpt-<version>/` atomically (temp folder, fsync, rename); keep the newest `keep`."""
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    for name, copy in snap.copies.items():
        write_safetensors(tmp / f"{name}.safetensors", copy.wait())  # fsynced
    (tmp / "meta.json").write_text(json.dumps(snap.meta, indent=1))
    with (tmp / "meta.json").open("rb") as fh:
        os.fsync(fh.fileno())
    final = root / f"ckpt-{snap.version:010d}"
    if final.exists():
        remove_folder(final)
    tmp.rename(final)
    if keep is not None:
        for v in checkpoint_versions(root)[:-keep]:
            remove_folder(root / f"ckpt-{v:010d}")
    return final


def _load_module(module: torch.nn.Module, file: Path, device: torch.device) -> None:
    """Load a module's tensors; only the second names of tied tensors may be absent from the file."""
    state = load_file(str(file), device=str(device))
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = set(module.state_dict()) - set(unique_state(module))
    if unexpected or set(missing) - tied:
        raise CheckpointMismatch(f"{file}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")


def read_meta(path: str | Path, parts: Trainables, run_id: str = "default") -> dict[str, Any]:
    """The meta of the checkpoint folder `path`, after checking it is one this learner may resume: a
    format it reads (2: one process; 3: sharded, learner/sharded_checkpoint.py), this run, this model."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") not in (FORMAT, 3):
        raise CheckpointMismatch(
            f"{path}: checkpoint format {meta.get('format')!r}, this learner reads {FORMAT} and 3"
        )
    want, got = identity(parts, run_id), meta["identity"]
    if got != want:
        raise CheckpointMismatch(
            f"{path} was written for run {got['run_id']!r}, model {got['model']}; this learner is run "
            f"{want['run_id']!r}, model {want['model']}: point checkpoint.checkpoint_dir elsewhere or "
            "remove the folder"
        )
    return meta


def restore_python_rng(meta: dict[str, Any]) -> None:
    version_, state, gauss = meta["python_rng"]
    random.setstate((version_, tuple(state), gauss))


def load_checkpoint(path: str | Path, parts: Trainables, run_id: str = "default") -> dict[str, Any]:
    """Restore `parts` and the RNGs from the one-process checkpoint folder `path`; return its meta.

    Raises `CheckpointMismatch` when the checkpoint belongs to another run or another model."""
    path = Path(path)
    meta = read_meta(path, parts, run_id)
    if meta["format"] != FORMAT:
        raise CheckpointMismatch(f"{path} is sharded (format 3): learner/sharded_checkpoint.py reads it")
    device = next(parts.model.parameters()).device
    _load_module(parts.model, path / "model.safetensors", device)
    _optimizer_from_files(parts.optimizer, load_file(str(path / "optimizer.safetensors")), meta["optimizer"])
    parts.scheduler.load_state_dict(meta["scheduler"])
    if parts.critic is not None and parts.critic_optimizer is not None:
        _load_module(parts.critic, path / "critic.safetensors", device)
        c_tensors = load_file(str(path / "critic_optimizer.safetensors"))
        _optimizer_from_files(parts.critic_optimizer, c_tensors, meta["critic_optimizer"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    restore_python_rng(meta)
    return meta
