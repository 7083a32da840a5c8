"""Resumable learner checkpoints: tensors in safetensors, everything else in JSON, written atomically.

A checkpoint is a folder `ckpt-<version>/` holding `model.safetensors` (+ `critic.safetensors`),
`optimizer.safetensors` (+ `critic_optimizer.safetensors`: AdamW moments flattened as `state.<i>.<name>`),
`rng.safetensors` (torch CPU / CUDA generator states) and `meta.json` (version, step, config, buffer
position, optimizer param groups, scheduler state, Python RNG). No pickle anywhere. It is written into a
temporary folder and renamed, so a learner killed mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

FORMAT = 1
CKPT_DIR = re.compile(r"^ckpt-(\d+)$")


@dataclass(slots=True)
class Trainables:
    """The stateful objects a checkpoint saves and restores (critic ones are None without GAE)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None


def _optimizer_to_files(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            key = f"state.{idx}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().cpu().contiguous()
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


def save_checkpoint(
    checkpoint_dir: str | Path,
    parts: Trainables,
    *,
    version: int,
    step: int,
    config: dict[str, Any],
    buffer_position: dict[str, Any],
    keep: int | None = None,
) -> Path:
    """Write `ckpt-<version>/` atomically; delete all but the newest `keep`; return the folder."""
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    save_model(parts.model, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _optimizer_to_files(parts.optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": version,
        "step": step,
        "saved_at": time.time(),
        "config": config,
        "buffer_position": buffer_position,
        "optimizer": opt_meta,
        "scheduler": parts.scheduler.state_dict(),
        "python_rng": random.getstate(),
    }
    if parts.critic is not None and parts.critic_optimizer is not None:
        save_model(parts.critic, str(tmp / "critic.safetensors"))
        c_tensors, meta["critic_optimizer"] = _optimizer_to_files(parts.critic_optimizer)
        save_file(c_tensors, str(tmp / "critic_optimizer.safetensors"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng |= {f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    save_file(rng, str(tmp / "rng.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    final = root / f"ckpt-{version:010d}"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    if keep is not None:
        for v in checkpoint_versions(root)[:-keep]:
            shutil.rmtree(root / f"ckpt-{v:010d}")
    return final


def load_checkpoint(path: str | Path, parts: Trainables) -> dict[str, Any]:
    """Restore `parts` and the RNGs from the checkpoint folder `path`; return its meta (version, ...)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this learner reads {FORMAT}")
    device = next(parts.model.parameters()).device
    load_model(parts.model, str(path / "model.safetensors"), device=str(device))
    _optimizer_from_files(parts.optimizer, load_file(str(path / "optimizer.safetensors")), meta["optimizer"])
    parts.scheduler.load_state_dict(meta["scheduler"])
    if parts.critic is not None and parts.critic_optimizer is not None:
        load_model(parts.critic, str(path / "critic.safetensors"), device=str(device))
        c_tensors = load_file(str(path / "critic_optimizer.safetensors"))
        _optimizer_from_files(parts.critic_optimizer, c_tensors, meta["critic_optimizer"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    version_, state, gauss = meta["python_rng"]
    random.setstate((version_, tuple(state), gauss))
    return meta
