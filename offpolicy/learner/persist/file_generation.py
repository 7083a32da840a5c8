"""A file generation: a host snapshot of the published weights, written as `v<version>/` whole or not at all.

A version folder holds the weights as safetensors (`model.safetensors`, or `model-0000i-of-0000n.safetensors`
shards + `model.safetensors.index.json` past `max_shard_bytes`), `config.json` (its `dtype` = the dtype the
weights are written in), `generation_config.json` when the model has one, the tokenizer files, and
`manifest.json`:

    {"format": 2, "version": 7, "sha256": "<PolicyRecord.sha256>",
     "files": {"model.safetensors": {"bytes": 123, "sha256": "<hex>"}, "config.json": {...}, ...}}

Every file's sha256 is computed while the file is written (no second read), each byte by one hasher: its
file's. `sha256` is the policy record's checksum, combined from the shards' own digests
(`offpolicy.weights.manifest.combine_sha256`: one file = its digest; shards = the sha256 of their `sha256sum`
listing).
Actors verify a load against the manifest without hashing the folder again.
The folder is written under a hidden temporary name, fsynced, then renamed into place: a reader, or a
learner resumed after `kill -9`, never sees half a version. `weights_uri` is the folder's path relative to
`publish.weights_root` when one is set (`weights_uri`; the actors resolve it under their own
`reload.weights_root`, so pods may mount the volume anywhere), else its absolute path.

A LoRA learner (`lora:` set) publishes the adapter alone (`kind: lora` in the policy record): the folder
holds `adapter_model.safetensors` (the adapter's tensors under their peft names, `model.lora.published_name`,
in the publish dtype; one file, as vLLM's LoRA loader reads it), `adapter_config.json`
(`model.lora.adapter_config`) and `manifest.json`, written the same way. No model config or tokenizer: the
actors serve the adapter on the base model they already hold.

`HostCopy` takes the snapshot (device -> host copy, cast to the publish dtype, into a reused host set:
weights/host_buffers.py, page-locked on CUDA) on a helper thread that overlaps the next forward/backward;
the learner waits for it only before its next optimizer step. `write_version` runs on the background
writer (persist/writer.py).
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config,
    is_adapter_name,
    published_name,
)
from offpolicy.learner.model.moe import is_moe
from offpolicy.learner.model.moe_names import checkpoint_entries, to_checkpoint
from offpolicy.learner.persist.version_folders import prune_versions, remove_folder, version_dir
from offpolicy.weights.host_buffers import reuse_or_new
from offpolicy.weights.manifest import MANIFEST, encode_manifest, manifest_doc, read_manifest
from offpolicy.weights.record import PolicyRecord
from offpolicy.weights.safetensors_io import (
    Arrivals,
    Entry,
    TensorStream,
    fsync_dir,
    write_small,
    write_streamed,
    write_weight_files,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

    from offpolicy.learner.config.lora import LoraConfig
    from offpolicy.learner.persist.delta_versions import DeltaVersions
    from offpolicy.weights.record import PolicyStore

# --- the snapshot (critical path)


class HostCopy:
    """Copies tensors to host memory on a helper thread while training goes on; `wait()` returns them.

    The destination buffers exist at once (`tensors`: one flat host allocation, weights/host_buffers.py);
    `into` offers a set to reuse (of the same names, shapes and dtypes). Floating tensors are cast to
    `dtype` (None = keep). CUDA sources are cast on the device and copied on a side stream that starts
    after everything queued so far, into a set page-locked at its exact size when `pin` (13.7 GB in
    ~0.25 s on an H100), so the copy overlaps the next forward and backward passes. The
    sources must not change until `wait()` returns: the learner waits before its next optimizer step.
    """

    def __init__(
        self,
        sources: dict[str, torch.Tensor],
        dtype: torch.dtype | None = None,
        into: dict[str, torch.Tensor] | None = None,
        pin: bool = True,
    ) -> None:
        self.sources = {k: v.detach() for k, v in sources.items()}
        specs = {
            name: (tuple(src.shape), dtype if dtype is not None and src.is_floating_point() else src.dtype)
            for name, src in self.sources.items()
        }
        pinned = pin and any(src.is_cuda for src in self.sources.values())
        self.tensors: dict[str, torch.Tensor] = reuse_or_new(into, specs, pinned)
        self._ready = None
        self._device = next((src.device for src in self.sources.values() if src.is_cuda), None)
        if self._device is not None:  # the sources' GPU, whichever is current (cuda:N on one process)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self._device))  # after the work queued so far
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="offpolicy-host-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._ready is None:
                for name, src in self.sources.items():
                    self.tensors[name].copy_(src)
                return
            stream = torch.cuda.Stream(device=self._device)
            stream.wait_event(self._ready)
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                for name, src in self.sources.items():
                    buf = self.tensors[name]
                    buf.copy_(src.to(buf.dtype), non_blocking=True)
            stream.synchronize()
        except Exception as exc:  # translated: re-raised by wait() in the caller's thread
            self._error = exc

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until the copy is complete; return the host tensors."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.tensors


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors of `model` under their model names (A, B, `modules_to_save` copies): what
    a LoRA learner publishes, in place of `unique_state`."""
    return {name: t for name, t in unique_state(model).items() if is_adapter_name(name)}


def snapshot_to_host(
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """`HostCopy(...).wait()`: a host copy of `tensors` (floating ones cast to `dtype`), synchronously."""
    return HostCopy(tensors, dtype, into).wait()


# --- writing (background)


@dataclass(frozen=True, slots=True)
class WeightsSnapshot:
    """Everything a version folder is written from, held in host memory."""

    version: int
    tensors: dict[str, torch.Tensor] | TensorStream  # host tensors in the publish dtype, or their stream
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    dtype: torch.dtype
    generation_config: GenerationConfig | None = None
    adapter: dict[str, Any] | None = None
    """A LoRA adapter's `adapter_config.json`: `tensors` are the adapter's (model names), and the folder is
    written in the adapter format (`config`, `tokenizer`, `generation_config` unused). None = full weights."""

    @property
    def kind(self) -> str:
        """The policy record's `kind` of this snapshot: `lora` or `full`."""
        return "full" if self.adapter is None else "lora"


def write_version(
    snap: WeightsSnapshot,
    weights_dir: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    delta: DeltaVersions | None = None,
) -> Path:
    """Write `v<version>/` with its manifest atomically (temp folder, fsync, rename); return the folder.
    `delta` (full weights, `publish.delta` on): the folder is a delta version when `delta` says so.

    An existing `v<version>/` (a resumed learner re-publishing a version) is replaced as a whole. A write
    that fails (a full disk) removes its temporary folder at once, then raises."""
    final = version_dir(weights_dir, snap.version)
    tmp = final.parent / f".tmp-v{snap.version}-{uuid.uuid4().hex}"
    delta = delta if snap.adapter is None else None
    try:
        is_delta = _write_folder(snap, tmp, max_shard_bytes, delta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (a full disk) gives its space back at once
        raise
    if final.exists():
        remove_folder(final)
    tmp.rename(final)
    fsync_dir(final.parent)
    if delta is not None:
        delta.commit(snap.version, is_delta)
    return final


def _write_folder(
    snap: WeightsSnapshot, tmp: Path, max_shard_bytes: int, delta: DeltaVersions | None = None
) -> bool:
    """Write the files of `snap` and their manifest into the new folder `tmp` (fsynced); True when it is a
    delta version."""
    stream = snap.tensors if isinstance(snap.tensors, TensorStream) else TensorStream.whole(snap.tensors)
    if snap.adapter is None and is_moe(snap.config):  # fused experts written per expert, as checkpoints are
        stream = _checkpoint_layout(stream, snap.config)
    arrivals = Arrivals(stream.chunks)
    base = delta.base_version if delta is not None and delta.wants_delta() else None
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        # The record's checksum is combined from the files' own digests (combine_sha256): each byte hashed
        # once.
        if snap.adapter is not None:
            files = _write_adapter(tmp, stream.entries, arrivals.take, snap.adapter)
        elif delta is None:
            files = write_weight_files(tmp, stream.entries, arrivals.take, max_shard_bytes)
        elif base is not None and (got := delta.write_delta(tmp, stream.entries, arrivals.take)) is not None:
            files = got
        elif base is not None:  # the delta came out too large: whole, from the base it filled
            files = write_weight_files(tmp, stream.entries, lambda e: delta.base[e[0]], max_shard_bytes)
            base = None
        else:
            files = write_weight_files(tmp, stream.entries, delta.recording(arrivals.take), max_shard_bytes)
    finally:
        arrivals.drain()
    if snap.adapter is None:
        files |= _write_model_files(tmp, snap, files)
    doc = manifest_doc(snap.version, files)
    if base is not None:
        doc["base"] = base
    write_small(tmp / MANIFEST, encode_manifest(doc))
    fsync_dir(tmp)
    return base is not None


def _checkpoint_layout(stream: TensorStream, config: PretrainedConfig) -> TensorStream:
    """`stream` under the MoE checkpoint's names (learner/model/moe_names.py): each fused expert tensor as
    one tensor per expert, split in its chunk as it arrives."""
    entries = [
        (n, shape, dtype)
        for name, shape, dtype in stream.entries
        for n, shape in checkpoint_entries(name, shape, config)
    ]
    return TensorStream(entries, (to_checkpoint(chunk, config) for chunk in stream.chunks))


def _write_model_files(tmp: Path, snap: WeightsSnapshot, files: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`config.json` (its dtype the publish dtype), `generation_config.json`, the tokenizer's files."""
    out: dict[str, dict[str, Any]] = {}
    config = copy.deepcopy(snap.config)
    config.dtype = snap.dtype
    out["config.json"] = write_small(tmp / "config.json", config.to_json_string(use_diff=False).encode())
    if snap.generation_config is not None:
        text = snap.generation_config.to_json_string(use_diff=True).encode()
        out["generation_config.json"] = write_small(tmp / "generation_config.json", text)
    if snap.tokenizer is not None:
        for saved in snap.tokenizer.save_pretrained(tmp):
            p = Path(saved)
            if p.is_file() and p.name not in files and p.name not in out:
                out[p.name] = write_small(p, p.read_bytes())  # rewritten through the hasher, fsynced
    return out


def _write_adapter(
    tmp: Path, entries: list[Entry], take: Callable[[Entry], torch.Tensor], adapter: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """A LoRA adapter as peft saves it and vLLM loads it: `adapter_model.safetensors` (one file, the tensors
    under their published names) and `adapter_config.json`. A tensor that is not the adapter's is refused
    (the base weights never go out as an adapter)."""
    stray = [name for name, _, _ in entries if not is_adapter_name(name)]
    if stray:
        raise ValueError(f"an adapter is published with {len(stray)} tensor(s) not its own: {stray[0]!r}")
    source = {published_name(name): (name, shape, dtype) for name, shape, dtype in entries}
    if len(source) != len(entries):
        raise ValueError("two adapter tensors have the same published name")
    named = [(published, shape, dtype) for published, (_, shape, dtype) in source.items()]
    files = {ADAPTER_WEIGHTS: write_streamed(tmp / ADAPTER_WEIGHTS, named, lambda e: take(source[e[0]]))}
    doc = json.dumps(adapter, indent=2, sort_keys=True).encode()
    files[ADAPTER_CONFIG] = write_small(tmp / ADAPTER_CONFIG, doc)
    return files


def weights_uri(folder: str | Path, weights_root: str | Path | None = None) -> str:
    """The record's `weights_uri` for a published folder: its POSIX path relative to `weights_root`, or its
    absolute path when there is no root. A folder outside the root is a `ValueError` naming both."""
    path = Path(folder).resolve()
    if weights_root is None:
        return str(path)
    root = Path(weights_root).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"published folder {path} is not under publish.weights_root {root}")
    return path.relative_to(root).as_posix()


def uri_folder(uri: str, weights_root: str | Path | None = None) -> Path:
    """The learner's folder of a record's `weights_uri` (`weights_uri` undone): a relative one under
    `weights_root` (the current folder when None), an absolute one as it is."""
    path = Path(uri.removeprefix("file://"))
    return path if path.is_absolute() else Path(weights_root or ".") / path


def _manifest_sha256(folder: Path) -> str:
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"{folder} has no manifest")
    return manifest["sha256"]


def publish_snapshot(
    snap: WeightsSnapshot,
    weights_dir: str | Path,
    *,
    store: PolicyStore | None = None,
    keep_versions: int | None = None,
    weights_root: str | Path | None = None,
    delta: DeltaVersions | None = None,
) -> PolicyRecord:
    """Write `v<version>/`, then SET + announce the policy record in `store`, then prune old versions.
    `weights_root`: the record names the folder relative to it (`weights_uri`); None = absolute path.
    `delta`: write a delta version when it says so (`publish.delta`)."""
    uri_of = weights_uri(version_dir(weights_dir, snap.version), weights_root)  # refused before writing
    folder = write_version(snap, weights_dir, delta=delta)
    record = PolicyRecord(
        version=snap.version,
        weights_uri=uri_of,
        sha256=_manifest_sha256(folder),
        published_at=time.time(),
        kind=snap.kind,
    )
    if store is not None:
        store.publish(record)
    if keep_versions is not None:
        prune_versions(weights_dir, keep_versions, protect=snap.version)
    return record


def publish_weights(
    model: torch.nn.Module,
    weights_dir: str | Path,
    version: int,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    store: PolicyStore | None = None,
    keep_versions: int | None = None,
    dtype: torch.dtype | None = None,
    weights_root: str | Path | None = None,
    lora: LoraConfig | None = None,
    base_model: str | Path | None = None,
    delta: DeltaVersions | None = None,
) -> PolicyRecord:
    """Snapshot `model` (cast to `dtype`, None = as it is) and publish it in the calling thread: the
    synchronous path (tests, tools, the benchmark's baseline); the learner uses the background writer.
    `lora`: `model` carries that adapter (`model.lora.inject`), and only the adapter is published (a record
    of kind `lora`; `base_model` = its `base_model_name_or_path`, default the model's own). `delta`: the
    version is a delta one when it says so (`publish.delta`)."""
    snap = WeightsSnapshot(
        version=version,
        tensors=snapshot_to_host(unique_state(model) if lora is None else adapter_state(model), dtype),
        config=model.config,
        tokenizer=tokenizer,
        dtype=dtype or next(model.parameters()).dtype,
        generation_config=getattr(model, "generation_config", None),
        adapter=None
        if lora is None
        else adapter_config(lora, model, str(base_model or model.config.name_or_path)),
    )
    return publish_snapshot(
        snap, weights_dir, store=store, keep_versions=keep_versions, weights_root=weights_root, delta=delta
    )
