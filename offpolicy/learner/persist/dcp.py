"""Checkpoints of a learner on N ranks: torch.distributed.checkpoint (sharded, asynchronous), no pickle.

A sharded checkpoint is a folder `ckpt-<version>/` holding `state/` (each rank's shards of the model (under
LoRA its adapter alone), AdamW moments and, with GAE, the critic and its optimizer, written by DCP's
`HuggingFaceStorageWriter`: safetensors files whose headers carry DCP's sharding metadata as JSON; DCP's
default writer would pickle its metadata) and rank 0's `meta.json` (format 3: everything of a single-process
checkpoint's meta but the tensors) and `rng.safetensors`. `ShardedCheckpoints` is the backend of a learner
on N ranks.

`save` runs on every rank at the same step boundary: `dcp.async_save` copies this rank's shards to host
memory, then writes them on a background thread, collectives on a process group of their own. With
`checkpoint.async_staging` (the default) the copy itself runs in the background too, into pinned host
buffers on CUDA that one `DefaultStager` keeps from one checkpoint to the next; the learner waits for it
(`staged`) only before its next optimizer step changes the weights: at 7B on 8 GPUs ~11 GB per rank leave
the critical path. Once rank 0's save completes (DCP's finish step runs after every rank has
written), rank 0 writes the meta, fsyncs and renames the temporary folder: a learner killed mid-write
(any rank) leaves the previous checkpoint intact, and the leftover `.tmp-*` folder is removed at the next
start. `load_sharded` reads a checkpoint back into the sharded (or, on one process, plain) model and optimizer
whatever world size wrote it: DCP reshards.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from offpolicy.learner.errors import CheckpointMismatch
from offpolicy.learner.persist.checkpoint import (
    FILE_FORMAT,
    SHARDED_FORMAT,
    Checkpoints,
    checkpoint_versions,
    holds_adapter,
    latest_checkpoint,
    read_meta,
    restore_rngs,
    rng_state,
    saved_names,
)
from offpolicy.learner.persist.version_folders import remove_folder
from offpolicy.learner.persist.writer import back_pressure
from offpolicy.weights.safetensors_io import write_safetensors

if TYPE_CHECKING:
    from offpolicy.learner.build import Trainables
    from offpolicy.learner.distributed.ranks import Ranks

log = logging.getLogger(__name__)

STATE_DIR = "state"


def _pairs(parts: Trainables) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    out = [("policy", parts.model, parts.optimizer)]
    if parts.critic is not None and parts.critic_optimizer is not None:
        out.append(("critic", parts.critic, parts.critic_optimizer))
    return out


def flat_state(parts: Trainables) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of the checkpoint under a flat name (`policy.model.<fqn>`, `policy.optim.<fqn>.<state>`,
    `critic....`: sharded DTensors on N ranks) and the optimizers' param groups (JSON, params by name)."""
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, Any] = {}
    for prefix, module, opt in _pairs(parts):
        model_sd, optim_sd = get_state_dict(module, opt)  # initialises AdamW's state if it has none yet
        saved = saved_names(module)  # under LoRA the adapter alone: the base is reloaded from model_path
        tensors |= {f"{prefix}.model.{k}": v for k, v in model_sd.items() if saved(k)}
        for fqn, state in optim_sd["state"].items():
            tensors |= {f"{prefix}.optim.{fqn}.{name}": v for name, v in state.items()}
        groups[prefix] = optim_sd["param_groups"]
    return tensors, groups


def _restore(parts: Trainables, tensors: dict[str, torch.Tensor], groups: dict[str, Any]) -> None:
    for prefix, module, opt in _pairs(parts):
        model_sd = {k[len(prefix) + 7 :]: v for k, v in tensors.items() if k.startswith(f"{prefix}.model.")}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in tensors.items():
            if k.startswith(f"{prefix}.optim."):
                fqn, name = k[len(prefix) + 7 :].rsplit(".", 1)
                state.setdefault(fqn, {})[name] = v
        saved = groups[prefix]
        param_groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g) for g in saved]
        set_state_dict(
            module,
            opt,
            model_state_dict=model_sd,
            optim_state_dict={"state": state, "param_groups": param_groups},
            # under LoRA the frozen base is not in the checkpoint; every saved tensor was read (`dcp.load`
            # fails on one missing from the files), so the names left out here are the base's alone
            options=StateDictOptions(strict=not holds_adapter(module)),
        )


@dataclass(slots=True)
class _InFlight:
    future: Future  # the upload: done once every rank's shards are written
    staging: Future | None  # asynchronous staging: done once this rank's shards are in host memory
    tmp: Path
    final: Path
    meta: dict[str, Any]
    rng: dict[str, torch.Tensor]
    version: int
    started: float  # perf_counter at the step boundary


class ShardedCheckpoints(Checkpoints):
    """The sharded checkpoints of one learner rank (at most one in flight); `on_durable(version, seconds)`
    on rank 0 once one is durable."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        ranks: Ranks,
        keep: int | None,
        on_durable: Callable[[int, float], None] | None = None,
        async_staging: bool = True,
        on_failed: Callable[[int, OSError], None] | None = None,
    ) -> None:
        self.root, self.run_id, self.ranks, self.keep = root, run_id, ranks, keep
        self._on_durable, self._on_failed = on_durable, on_failed
        self._inflight: _InFlight | None = None
        self._group = dist.new_group(backend="gloo") if ranks.distributed else None  # checkpoints only
        cuda = torch.cuda.is_available()
        # one stager for the run: its (pinned, on CUDA) host buffers are reused by the next checkpoint
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=async_staging,
                use_non_blocking_copy=cuda,
            )
        )

    def save(self, parts: Trainables, version: int, meta: dict[str, Any]) -> Path:
        """Every rank, same step boundary: stage this rank's shards in host memory, write in the background.
        `meta` (rank 0's) is written once every rank's shards are on disk. Returns the final folder."""
        self.finish()  # one at a time: the previous one is normally long done
        tmp, final = self.root / f".tmp-ckpt-{version:010d}", self.root / f"ckpt-{version:010d}"
        if self.ranks.is_leader:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        if self.ranks.distributed:
            dist.barrier(group=self._group)  # the folder is clean before any rank writes into it
        started = time.perf_counter()
        tensors, groups = flat_state(parts)
        writer = HuggingFaceStorageWriter(str(tmp / STATE_DIR), save_distributed=True)
        saved = dcp.async_save(
            tensors, storage_writer=writer, process_group=self._group, async_stager=self._stager
        )
        future, staging = (
            (saved.upload_completion, saved.staging_completion)
            if isinstance(saved, AsyncSaveResponse)
            else (saved, None)
        )
        rng = rng_state()
        meta = meta | {"format": SHARDED_FORMAT, "world_size": self.ranks.world_size, "param_groups": groups}
        self._inflight = _InFlight(future, staging, tmp, final, meta, rng, version, started)
        return final

    def staged(self) -> None:
        """Block until this rank's shards of the checkpoint in flight are in host memory (asynchronous
        staging: before the next optimizer step changes the weights or AdamW state)."""
        if self._inflight is not None and self._inflight.staging is not None:
            self._inflight.staging.result()

    def poll(self) -> None:
        """Step boundary: finalise the checkpoint in flight if its write has completed."""
        if self._inflight is not None and self._inflight.future.done():
            self.finish()

    def finish(self) -> None:
        """Wait for the checkpoint in flight (if any) and make it durable (rank 0: meta, fsync, rename).
        One that failed with an `OSError` (a full disk) is reported (`on_failed`), its partial folder
        removed (rank 0), and not retried: the next checkpoint due tries again."""
        job, self._inflight = self._inflight, None
        if job is None:
            return
        try:
            self._finish(job)
        except Exception as exc:
            os_error = _os_error(exc)
            if os_error is None:
                raise
            if self.ranks.is_leader:
                shutil.rmtree(job.tmp, ignore_errors=True)
            log.error("checkpoint v%d failed on rank %d: %s", job.version, self.ranks.rank, exc)
            if self._on_failed is not None:
                self._on_failed(job.version, os_error)

    def _finish(self, job: _InFlight) -> None:
        if job.staging is not None:
            job.staging.result()
        job.future.result()  # raises what the background write raised
        if not self.ranks.is_leader:
            return
        write_safetensors(job.tmp / "rng.safetensors", job.rng)
        (job.tmp / "meta.json").write_text(json.dumps(job.meta, indent=1))
        with (job.tmp / "meta.json").open("rb") as fh:
            os.fsync(fh.fileno())
        if job.final.exists():
            remove_folder(job.final)
        job.tmp.rename(job.final)
        if self.keep is not None:
            for v in checkpoint_versions(self.root)[: -self.keep]:
                remove_folder(self.root / f"ckpt-{v:010d}")
        seconds = time.perf_counter() - job.started
        log.info("checkpoint v%d durable %.2f s after its step boundary", job.version, seconds)
        if self._on_durable is not None:
            self._on_durable(job.version, seconds)

    def close(self) -> None:
        self.finish()
        self._stager.close()

    def pending(self) -> bool:
        return self._inflight is not None

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def load(self, path: Path, parts: Trainables) -> dict[str, Any]:
        """Every rank: read `path` (whatever world size wrote it); a one-process checkpoint is refused."""
        meta = read_meta(path, parts, self.run_id)
        if meta["format"] == FILE_FORMAT:
            raise CheckpointMismatch(
                f"{path} was written by a one-process learner; a learner on {self.ranks.world_size} ranks "
                "reads sharded checkpoints only: resume it with --nproc-per-node 1"
            )
        return load_sharded(path, parts, self.ranks)


def _os_error(exc: BaseException) -> OSError | None:
    """The back-pressure `OSError` behind `exc` (itself, its causes, or one of DCP's per-rank `failures`),
    if any (persist/writer.py `back_pressure`)."""
    seen: list[BaseException] = [exc]
    visited: set[int] = set()
    while seen:
        e = seen.pop()
        if id(e) in visited:
            continue
        visited.add(id(e))
        if back_pressure(e):
            return e  # type: ignore[return-value]
        seen.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            seen.extend(f for f in failures.values() if isinstance(f, BaseException))
    return None


def load_sharded(path: Path, parts: Trainables, ranks: Ranks) -> dict[str, Any]:
    """Every rank: read the sharded checkpoint `path` into `parts` (any world size wrote it, one process
    reads it too); its meta, checked by `checkpoint.read_meta` before."""
    meta = json.loads((path / "meta.json").read_text())
    tensors, _ = flat_state(parts)
    reader = HuggingFaceStorageReader(str(path / STATE_DIR))
    dcp.load(tensors, storage_reader=reader, process_group=ranks.control if ranks.distributed else None)
    _restore(parts, tensors, meta["param_groups"])
    parts.scheduler.load_state_dict(meta["scheduler"])
    restore_rngs(path, meta)
    return meta
