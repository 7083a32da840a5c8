"""The names of an MoE policy's experts in published weights: the Hugging Face checkpoint layout.

Inside the learner (transformers 5) a sparse block's experts are two fused 3-D parameters:
`model.layers.{i}.mlp.experts.gate_up_proj` (E, 2I, H: gate rows, then up rows) and
`model.layers.{i}.mlp.experts.down_proj` (E, H, I). A published version is written as the models'
own checkpoints are (what `save_pretrained` writes and what every vLLM version's `load_weights` maps with
its `expert_params_mapping`): one 2-D tensor per expert and projection,
- Qwen3-MoE, Qwen2-MoE, DeepSeek-V2/V3: `mlp.experts.{e}.gate_proj.weight` (I, H), `.up_proj.weight`
  (I, H), `.down_proj.weight` (H, I);
- Mixtral: `block_sparse_moe.experts.{e}.w1.weight` (gate), `.w3.weight` (up), `.w2.weight` (down), and
  the router `block_sparse_moe.gate.weight`.
`to_checkpoint` splits (views, no copies), `from_checkpoint` is its inverse (stacks), `checkpoint_entries`
maps (name, shape) alone (the layout of a streamed write before its tensors arrive). Dense models and
names outside the experts pass through unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import torch

QWEN_STYLE = frozenset({"qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"})
MIXTRAL_STYLE = frozenset({"mixtral"})
SUPPORTED = QWEN_STYLE | MIXTRAL_STYLE
_FUSED = re.compile(r"^(?P<pre>.*\.)mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")
_SPLIT = re.compile(r"^(?P<pre>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


def _names(model_type: str) -> tuple[str, str, str, str]:
    """(block, gate, up, down) names of the checkpoint layout of `model_type`."""
    if model_type in MIXTRAL_STYLE:
        return "block_sparse_moe", "w1", "w3", "w2"
    if model_type in QWEN_STYLE:
        return "mlp", "gate_proj", "up_proj", "down_proj"
    raise ValueError(
        f"model_type {model_type!r}: no checkpoint layout known for its fused experts (supported: "
        f"{sorted(SUPPORTED)})"
    )


def _block_renamed(name: str, model_type: str) -> str:
    """Mixtral's checkpoint calls the sparse block `block_sparse_moe` (transformers 5: `mlp`)."""
    return name.replace(".mlp.", ".block_sparse_moe.") if model_type in MIXTRAL_STYLE else name


def checkpoint_entries(name: str, shape: tuple[int, ...], config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's (name, shape) pieces of the learner's tensor `name` of `shape`."""
    match = _FUSED.match(name)
    if match is None or len(shape) != 3:
        return [(_block_renamed(name, getattr(config, "model_type", "")), tuple(shape))]
    block, gate, up, down = _names(config.model_type)
    pre, (e_count, rows, cols) = match["pre"], shape
    if match["kind"] == "down_proj":
        return [(f"{pre}{block}.experts.{e}.{down}.weight", (rows, cols)) for e in range(e_count)]
    half = rows // 2
    return [
        (f"{pre}{block}.experts.{e}.{proj}.weight", (half, cols))
        for e in range(e_count)
        for proj in (gate, up)
    ]


def to_checkpoint(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """`tensors` (the learner's names) in the checkpoint layout: fused experts split per expert (views
    of the fused tensors, each contiguous: a leading index, then a range of rows)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        pieces = checkpoint_entries(name, tuple(t.shape), config)
        if len(pieces) == 1 and pieces[0][1] == tuple(t.shape):
            out[pieces[0][0]] = t
            continue
        half = t.shape[1] // 2
        parts = (
            [t[e] for e in range(t.shape[0])]  # (H, I) each: down_proj
            if name.endswith("down_proj")
            else [p for e in range(t.shape[0]) for p in (t[e, :half], t[e, half:])]  # (I, H): gate, up
        )
        out.update(zip((n for n, _ in pieces), parts, strict=True))
    return out


def from_checkpoint(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The inverse of `to_checkpoint`: per-expert tensors stacked back into the fused parameters."""
    model_type = getattr(config, "model_type", "")
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        match = _SPLIT.match(name)
        if match is None:
            out[name.replace(".block_sparse_moe.", ".mlp.") if model_type in MIXTRAL_STYLE else name] = t
            continue
        experts.setdefault((match["pre"], match["proj"]), {})[int(match["e"])] = t
    if not experts:
        return out
    _, gate, up, down = _names(model_type)
    for pre in sorted({p for p, _ in experts}):
        gates, ups, downs = (experts[(pre, proj)] for proj in (gate, up, down))
        order = sorted(downs)
        out[f"{pre}mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([gates[e], ups[e]], dim=0) for e in order]
        )  # (E, 2I, H)
        out[f"{pre}mlp.experts.down_proj"] = torch.stack([downs[e] for e in order])  # (E, H, I)
    return out
