"""Layered YAML + environment loading for the frozen pydantic configs of every process.

One rule for the learner's and the actors' `load_config`: the YAML file, then the `OFFPOLICY_*`
variables of the mapping passed in (`__` nests: `OFFPOLICY_OPTIMIZER__LR` sets `optimizer.lr`, values
parsed as YAML scalars), then keyword overrides, each merged deeply over the one before. Only the mapping
given as `environ` is read, and only at call time: nothing here touches `os.environ`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

ENV_PREFIX = "OFFPOLICY_"
ENV_NESTING = "__"

M = TypeVar("M", bound=BaseModel)


def env_overrides(environ: Mapping[str, str], prefix: str = ENV_PREFIX) -> dict[str, Any]:
    """`OFFPOLICY_OPTIMIZER__LR=0.001` → {"optimizer": {"lr": 0.001}}; values parsed as YAML scalars,
    an empty value is None."""
    out: dict[str, Any] = {}
    for key, raw in sorted(environ.items()):
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix) :].lower().split(ENV_NESTING)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
    return out


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of plain dicts (`over` wins); used for YAML + env and for PATCH bodies."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def load_layered(
    model_cls: type[M],
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    prefix: str = ENV_PREFIX,
) -> M:
    """A `model_cls` from the YAML file at `path` (None = none), then the `prefix` variables of `environ`
    (None = none), then `overrides`.

    Only variables whose first level names a field of `model_cls` are taken, so other components'
    variables (`OFFPOLICY_API_TOKEN`, `OFFPOLICY_CONFIG_PATH`) are ignored. A YAML file whose top level
    is not a mapping raises ValueError naming the file; invalid values raise pydantic's ValidationError.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    if environ is not None:
        env = {k: v for k, v in env_overrides(environ, prefix).items() if k in model_cls.model_fields}
        data = merge(data, env)
    return model_cls.model_validate(merge(data, overrides or {}))
