"""Lean start of a learner on N ranks: the model built without weights, each rank reading only its shards.

Loading the whole model on every rank and then sharding it costs each rank the full fp32 model in host
memory at start-up (8 ranks x 28 GB at 7B on one node). Here every rank

1. builds the model's modules with their parameters on the meta device (`meta_model`: no memory; buffers
   such as the rotary tables stay real, computed by the model's own constructor);
2. shards it (`fully_shard`, learner/distributed/fsdp.py), still on meta;
3. allocates its shards alone (`materialize`: `to_empty` on the GPU, or in host memory with CPU offload);
4. fills them (`load_shards`): for each parameter, the rows of its shard are read from the safetensors
   files straight into the shard (plain reads at the rows' byte offsets: no mmap, no full tensor), cast
   to the master dtype on the way; the transient is at most one shard of one tensor in the checkpoint's
   dtype.

A checkpoint whose tensors do not map one to one onto the model's parameters (renamed or fused tensors
that transformers converts while loading, a missing tensor, another layout) takes the other way: rank 0
loads it with transformers (the one full copy, in host memory, on rank 0 only) and
`set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)` sends every rank its shards,
one tensor at a time (`broadcast_from_rank0`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from offpolicy.learner.distributed.ranks import current
from offpolicy.learner.model import lora
from offpolicy.learner.model.load import load_model

log = logging.getLogger(__name__)

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lands on the meta device (buffers stay where they are made):
    a model's constructor runs, allocating no weights (`torch.empty` pages never touched, then dropped)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def local_checkpoint(path: str | Path) -> Path:
    """The local folder of a checkpoint: `path` itself when it is a folder, else a Hugging Face hub id
    resolved to its snapshot in the local cache (downloaded first unless `HF_HUB_OFFLINE` is set). The
    lean start reads the safetensors files' slices from there; a hub id that no snapshot answers is an
    error naming it, never a silent fallback to rank 0 loading the whole model."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), allow_patterns=["*.safetensors", "*.json"]))
    except (HFValidationError, LocalEntryNotFoundError, OSError) as e:
        raise FileNotFoundError(
            f"model_path {str(path)!r} is neither a folder nor a hub id with a snapshot in the local cache "
            f"(HF_HOME / HF_HUB_CACHE): {e}"
        ) from e


def meta_model(path: str | Path, dtype: torch.dtype, *, causal: bool = True, **kwargs: Any) -> nn.Module:
    """The model at `path` (a causal LM, or with `causal=False` its backbone) with its parameters on the
    meta device in `dtype` and its buffers real, in train mode; its generation config read as
    `from_pretrained` reads it. `kwargs` go to `from_config` (e.g. `attn_implementation`)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(path))
    auto = AutoModelForCausalLM if causal else AutoModel
    with parameters_on_meta():
        model = auto.from_config(config, dtype=dtype, **kwargs)
    if causal:
        with contextlib.suppress(OSError, ValueError):
            model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model.train()


def unique_names(module: nn.Module) -> list[str]:
    """`module.state_dict()`'s names without the second name of a tied tensor (as `save_pretrained`
    drops them), by identity: works on meta tensors, whose storages all look alike."""
    seen: set[int] = set()
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(name)
    return out


def materialize(root: nn.Module, device: torch.device) -> None:
    """Allocate the sharded `root`'s parameters (each rank its shards) on `device`, keeping its buffers:
    `to_empty` gives every tensor fresh, uninitialised memory, so the buffers are copied back."""
    buffers = {name: b.detach().clone() for name, b in root.named_buffers()}
    root.to_empty(device=device)
    with torch.no_grad():
        for name, b in root.named_buffers():
            b.copy_(buffers[name])


# --- reading the checkpoint's slices


class _Index:
    """Where each tensor of a safetensors checkpoint lies: file, byte offset of its data, dtype, shape."""

    def __init__(self, folder: Path) -> None:
        self.entries: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}
        files = sorted(folder.glob("*.safetensors"))
        for f in files:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, e in header.items():
                if name == "__metadata__" or e["dtype"] not in _DTYPES:
                    continue
                self.entries[name] = (f, 8 + n + e["data_offsets"][0], _DTYPES[e["dtype"]], tuple(e["shape"]))

    def find(self, name: str, prefix: str) -> str | None:
        for key in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
            if key in self.entries:
                return key
        return None


def _plan(
    model: nn.Module, index: _Index, names: Callable[[str], str | None] | None = None
) -> dict[str, tuple[str, torch.Tensor]] | None:
    """model tensor name -> (checkpoint name, the model's tensor), for every parameter and persistent
    buffer that `names` maps to a checkpoint name (None = all, under their own names); None when the
    checkpoint does not map one to one (another name, shape, or a tensor missing)."""
    prefix = getattr(model, "base_model_prefix", "model")
    plan = {}
    state = model.state_dict(keep_vars=True)
    for name in unique_names(model):
        t = state[name]
        wanted = name if names is None else names(name)
        if wanted is None:  # not in the checkpoint (a LoRA factor): the caller fills it
            continue
        key = index.find(wanted, prefix)
        if key is None or index.entries[key][3] != tuple(t.shape):
            log.info("lean start: %s has no tensor of shape %s in the checkpoint", name, tuple(t.shape))
            return None
        plan[name] = (key, t)
    return plan


def _read_rows(
    entry: tuple[Path, int, torch.dtype, tuple[int, ...]], start: int, rows: int, out: torch.Tensor
) -> None:
    """Copy rows [start, start + rows) of a checkpoint tensor into `out` (any dtype and device)."""
    path, offset, dtype, shape = entry
    row_bytes = dtype.itemsize
    for d in shape[1:]:
        row_bytes *= d
    if rows == 0 or row_bytes == 0:
        return
    direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
    buf = out if direct else torch.empty((rows, *shape[1:]), dtype=dtype)
    with path.open("rb", buffering=0) as fh:
        fh.seek(offset + start * row_bytes)
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B") if buf.numel() else memoryview(b"")
        got = 0
        while got < len(view):
            n = fh.readinto(view[got:])
            if not n:
                raise OSError(f"{path}: short read at {offset + start * row_bytes + got}")
            got += n
    if not direct:
        out.copy_(buf.view(out.shape))


def load_shards(
    model: nn.Module, folder: str | Path, names: Callable[[str], str | None] | None = None
) -> bool:
    """Fill the materialised, sharded `model`'s shards from the safetensors files in `folder`, each rank
    reading the rows of its own shards only. `names`: a model tensor's name in the checkpoint, None for a
    tensor the checkpoint does not hold (left as it is); default: the model's own names. False (nothing
    read) when the checkpoint does not map one to one onto the model: use `broadcast_from_rank0` then
    (every rank decides the same: same files)."""
    index = _Index(Path(folder))
    plan = _plan(model, index, names) if index.entries else None
    if plan is None:
        return False
    with torch.no_grad():
        for key, t in plan.values():
            entry = index.entries[key]
            if not isinstance(t, DTensor):  # not sharded (a persistent buffer): whole
                _read_rows(entry, 0, t.shape[0] if t.dim() else 1, t.data)
                continue
            local = t.to_local()
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            if tuple(shape[1:]) == tuple(t.shape[1:]):  # FSDP2: a block of whole rows (dim 0)
                _read_rows(entry, offset[0], shape[0], local)
            else:  # another layout: the whole tensor, then this rank's block
                whole = torch.empty(t.shape, dtype=entry[2])
                _read_rows(entry, 0, t.shape[0], whole)
                copy_block(t, whole)
    return True


def copy_block(t: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's block of `whole` (the full tensor, the same on every rank) into `t`: a sharded
    DTensor's local shard (cast to its dtype and device on the way), or all of a plain tensor. No
    collective: each rank slices its own rows (a lean start's LoRA factors, drawn alike on every rank)."""
    with torch.no_grad():
        if not isinstance(t, DTensor):
            t.copy_(whole)
            return
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        t.to_local().copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))])


def broadcast_from_rank0(root: nn.Module, prefix: str, full: dict[str, torch.Tensor] | None) -> None:
    """Every rank: `root`'s shards from the full state dict that rank 0 alone holds (`full`, names relative
    to `root.<prefix>`; None elsewhere), sent one tensor at a time. Tensors of `root` outside `prefix`
    (a critic's head) are left as they are."""
    state = {f"{prefix}.{k}": v for k, v in full.items()} if full is not None else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(root, state, options=opts)


# --- the lean start of one model (learner/build.py)


def fill(
    root: torch.nn.Module,
    prefix: str,
    model: torch.nn.Module,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    causal: bool = True,
    lora_seed: int | None = None,
) -> str:
    """Lean start: allocate the sharded `root`'s shards on `device` and load `model`'s (= `root.<prefix>`)
    weights from `path` (a folder, or a hub id resolved to its local snapshot first) into them: each rank
    its slices, or rank 0 reads and broadcasts when the checkpoint does not map one to one
    (learner/distributed/lean.py), said in a warning. Returns the way taken: `slices` | `broadcast`.

    `lora_seed` (a LoRA adapter injected into `model`): the base weights are read under their checkpoint
    names (`lora.base_name`), and each rank copies its rows of the factors drawn from the seed
    (`lora.initial_factor`: the same whole tensors on every rank, no collective)."""
    materialize(root, device)
    path = local_checkpoint(path)
    names = None if lora_seed is None else lora_base_names
    if load_shards(model, path, names):
        log.info("lean start: %s read from %s, each rank its own slices", type(root).__name__, path)
        way = "slices"
    else:
        _broadcast_whole(root, prefix, model, path, dtype, causal, names)
        way = "broadcast"
    if lora_seed is not None:
        for name, p in model.named_parameters():
            if lora.is_factor(name):
                copy_block(p, lora.initial_factor(name, p.shape, lora_seed))
    return way


def lora_base_names(name: str) -> str | None:
    """A LoRA model's tensor name in the base checkpoint; None for a factor (not there: drawn)."""
    return None if lora.is_factor(name) else lora.base_name(name)


def _broadcast_whole(
    root: torch.nn.Module,
    prefix: str,
    model: torch.nn.Module,
    path: Path,
    dtype: torch.dtype,
    causal: bool,
    names: Callable[[str], str | None] | None,
) -> None:
    """Rank 0 loads the whole checkpoint and broadcasts it into every rank's shards (under `model`'s names:
    `names` maps them to the checkpoint's; a tensor it maps to None is left as it is)."""
    full = None
    if current().is_leader:  # the one full copy, on rank 0
        from transformers import AutoModel

        full = (
            load_model(path, "cpu", dtype) if causal else AutoModel.from_pretrained(path, dtype=dtype)
        ).state_dict()
        if names is not None:
            full = {n: full[c] for n in unique_names(model) if (c := names(n)) is not None and c in full}
    broadcast_from_rank0(root, prefix, full)
    log.warning(
        "lean start: the safetensors in %s do not map one to one onto %s: rank 0 read the whole model and "
        "broadcast it (host memory on rank 0: the whole checkpoint)", path, type(root).__name__,
    )  # fmt: skip
