"""Resumable learner checkpoints: what every layout shares, and the interface of their backends.

A checkpoint is a folder `ckpt-<version>/` under `checkpoint.checkpoint_dir`: its tensors in safetensors,
everything else in `meta.json` (version, step, config, buffer position, the leases it holds, scheduler
state, Python RNG, and the identity it was written for: run id and model fingerprint), written under a
temporary name, fsynced and renamed, so a learner killed mid-write leaves the previous checkpoint intact.
No pickle anywhere. A checkpoint of another run or model is refused (`CheckpointMismatch`). Under LoRA
the policy's tensors are its adapter's alone (`saved_names`; meta `lora: true`) with its AdamW state: the
frozen base is reloaded from `model_path`; a LoRA checkpoint is refused by a full-weight learner and the
other way round.

Two layouts, one backend each behind `Checkpoints` (save / staged / poll / finish / close / latest / load),
chosen once when the learner starts:
- `FILE_FORMAT` (one process; persist/single.py): whole tensors, copied to host memory at the step
  boundary and written by the background writer (persist/writer.py);
- `SHARDED_FORMAT` (N ranks; persist/sharded.py): each rank's shards through torch.distributed.checkpoint,
  asynchronous; any world size reads it back (one process too).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from offpolicy.learner.errors import CheckpointMismatch, CheckpointsDisabled
from offpolicy.learner.model import lora

if TYPE_CHECKING:
    from offpolicy.learner.build import Trainables

FILE_FORMAT = 2
SHARDED_FORMAT = 3
CKPT_DIR = re.compile(r"^ckpt-(\d+)$")


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


def identity(parts: Trainables, run_id: str) -> dict[str, str]:
    """What a checkpoint must match to be resumed: the run id and a fingerprint of the model's tensors
    (names, shapes and dtypes of its state dict), so another run's or another model's is refused."""
    spec = [(k, list(v.shape), str(v.dtype)) for k, v in parts.model.state_dict().items()]
    return {"run_id": run_id, "model": hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]}


def holds_adapter(module: torch.nn.Module) -> bool:
    """Whether `module` trains a LoRA adapter on a frozen base (learner/model/lora.py)."""
    return any(lora.is_adapter_name(n) for n, _ in module.named_parameters())


def saved_names(module: torch.nn.Module) -> Callable[[str], bool]:
    """Which of `module`'s state dict entries a checkpoint holds: all of them, or under LoRA the adapter's
    alone (the frozen base is reloaded from `model_path` on resume: GBs not written at every checkpoint)."""
    if holds_adapter(module):
        return lora.is_adapter_name
    return lambda _name: True


def base_meta(
    parts: Trainables,
    *,
    version: int,
    step: int,
    run_id: str,
    config: dict[str, Any],
    buffer_position: dict[str, Any],
    lease_ids: list[str] | None = None,
    config_version: int = 0,
    lease_priorities: dict[str, float] | None = None,
) -> dict[str, Any]:
    """What every checkpoint's `meta.json` holds, whatever its layout: identity, counters, the config the
    learner trains with and its version (reapplied at resume: learner/config/resume.py), buffer position,
    the leases it holds (and their groups' new priorities), the scheduler and the Python RNG."""
    return {
        "identity": identity(parts, run_id),
        "lora": holds_adapter(parts.model),  # the policy's tensors are its adapter's alone
        "version": version,
        "step": step,
        "saved_at": time.time(),
        "config": config,
        "config_version": config_version,
        "buffer_position": buffer_position,
        "lease_ids": list(lease_ids or []),
        "lease_priorities": dict(lease_priorities or {}),
        "scheduler": parts.scheduler.state_dict(),
        "python_rng": random.getstate(),
    }


def read_meta(path: str | Path, parts: Trainables, run_id: str = "default") -> dict[str, Any]:
    """The meta of the checkpoint folder `path`, after checking it is one this learner may resume: a
    format it reads (`FILE_FORMAT`: one process; `SHARDED_FORMAT`: N ranks), this run, this model."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") not in (FILE_FORMAT, SHARDED_FORMAT):
        raise CheckpointMismatch(
            f"{path}: checkpoint format {meta.get('format')!r}, this learner reads {FILE_FORMAT} and "
            f"{SHARDED_FORMAT}"
        )
    saved, mine = bool(meta.get("lora", False)), holds_adapter(parts.model)
    if saved != mine:
        kinds = {True: "a LoRA adapter (the base model reloaded from model_path)", False: "full weights"}
        raise CheckpointMismatch(
            f"{path} holds {kinds[saved]}, but this learner trains {kinds[mine]}: resume it with the `lora` "
            f"section it was written with (now {'set' if mine else 'unset'}), or point "
            "checkpoint.checkpoint_dir elsewhere"
        )
    want, got = identity(parts, run_id), meta["identity"]
    if got != want:
        raise CheckpointMismatch(
            f"{path} was written for run {got['run_id']!r}, model {got['model']}; this learner is run "
            f"{want['run_id']!r}, model {want['model']}: point checkpoint.checkpoint_dir elsewhere or "
            "remove the folder"
        )
    return meta


def rng_state() -> dict[str, torch.Tensor]:
    """The torch CPU and CUDA generator states, as tensors (a checkpoint's `rng.safetensors`)."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng |= {f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return rng


def restore_rngs(path: Path, meta: dict[str, Any]) -> None:
    """Restore the torch generators from `path/rng.safetensors` and the Python one from `meta`."""
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and (
        cuda := [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
    ):
        torch.cuda.set_rng_state_all(cuda)
    version_, state, gauss = meta["python_rng"]
    random.setstate((version_, tuple(state), gauss))


# --- the interface of the backends


class Checkpoints(ABC):
    """The checkpoints of one learner process, one backend chosen at construction
    (`persist.single.make_checkpoints`): `single.FileCheckpoints` (one process), `sharded.
    ShardedCheckpoints` (N ranks, DCP) or `NoCheckpoints` (disabled)."""

    @abstractmethod
    def save(self, parts: Trainables, version: int, meta: dict[str, Any]) -> Path:
        """Step boundary: start the host snapshot of `parts` and queue the write; the folder it will have.
        `meta` is `base_meta(...)`. On N ranks every rank calls it (a collective)."""

    def staged(self) -> None:  # noqa: B027 (a backend whose save stages synchronously has nothing to wait)
        """Block until the snapshot of the last `save` is in host memory (before the weights change)."""

    def poll(self) -> None:  # noqa: B027 (a backend whose writes report themselves has nothing to poll)
        """Step boundary: a checkpoint whose write has completed becomes durable."""

    @abstractmethod
    def finish(self) -> None:
        """Wait until the checkpoint in flight (if any) is durable."""

    def close(self) -> None:
        """`finish`, then release what the backend holds (threads, host buffers)."""
        self.finish()

    def pending(self) -> bool:
        """Whether a checkpoint is being written or waits for its (re)try."""
        return False

    def snapshot_bytes(self) -> int | None:
        """About the bytes the newest checkpoint's write needs on disk (None = unknown)."""
        return None

    @abstractmethod
    def latest(self) -> Path | None:
        """The newest complete checkpoint folder, or None."""

    @abstractmethod
    def load(self, path: Path, parts: Trainables) -> dict[str, Any]:
        """Restore `parts` and the RNGs from the checkpoint folder `path` (after `read_meta`'s checks);
        return its meta. A layout this backend cannot read raises `CheckpointMismatch`."""


class NoCheckpoints(Checkpoints):
    """Checkpoints disabled (`checkpoint.checkpoint_dir: null`): nothing to resume, `save` refuses."""

    def save(self, parts: Trainables, version: int, meta: dict[str, Any]) -> Path:
        raise CheckpointsDisabled("checkpoints are disabled: checkpoint.checkpoint_dir is null")

    def finish(self) -> None:
        return None

    def latest(self) -> Path | None:
        return None

    def load(self, path: Path, parts: Trainables) -> dict[str, Any]:
        raise CheckpointsDisabled(f"checkpoints are disabled: {path} is not read")
