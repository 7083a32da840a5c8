"""The one layered loader for the config of every process: YAML, then `OFFPOLICY_*` env, then overrides.

Learner (`offpolicy.learner.config.load_config`), actors (`offpolicy.actors.config.load_config`) and the
service processes'
settings (`offpolicy.services.common.settings.ServiceSettings.from_env`) all load through `load_layered`: the
YAML
file, then the `OFFPOLICY_*` variables of the mapping passed in (`__` nests: `OFFPOLICY_OPTIMIZER__LR`
sets `optimizer.lr`), then keyword overrides, each merged deeply over the one before, validated once by
the (strict, `offpolicy.config.base.ConfigModel`) model. Only the mapping given as `environ` is read, and
only at
call time: nothing here touches `os.environ`.

Environment values: empty means None; a value for a field that holds text (`str`, `SecretStr`, `Path`,
alone or in a union with them: a token, a run id, a threshold spec) is taken as written, so
`OFFPOLICY_API_TOKEN=123456` stays the string `"123456"`; any other value is read as a YAML scalar or
flow collection (`2`, `1e-5`, `true`, `[0.9, 0.99]`) and then validated like a YAML file's value.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr

ENV_PREFIX = "OFFPOLICY_"
ENV_NESTING = "__"
_TEXT_TYPES = (str, SecretStr, Path)

M = TypeVar("M", bound=BaseModel)


def env_overrides(environ: Mapping[str, str], prefix: str = ENV_PREFIX) -> dict[str, Any]:
    """`OFFPOLICY_OPTIMIZER__LR=0.001` → {"optimizer": {"lr": 0.001}}; values parsed as YAML scalars,
    an empty value is None. Knows no model: `load_layered` applies the text-field rule on top."""
    return _env_tree(environ, prefix, lambda parts, raw: _yaml_value(raw))


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of plain dicts (`over` wins); used for YAML + env and for PATCH bodies."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves that differ between two plain dicts (a nested dict counts as a node),
    sorted; used for a config change's `changed_fields` and for a resumed config's disagreements."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(changed_fields(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(prefix + key)
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
    variables (`OFFPOLICY_API_TOKEN` for a learner config, `OFFPOLICY_RUN_ID` for the service settings)
    are ignored. A YAML file whose top level is not a mapping raises ValueError naming the file; invalid
    values raise pydantic's ValidationError.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    if environ is not None:
        env = _env_tree(environ, prefix, lambda parts, raw: _env_value(model_cls, parts, raw), model_cls)
        data = merge(data, env)
    return model_cls.model_validate(merge(data, overrides or {}))


# --- environment values


def _env_tree(
    environ: Mapping[str, str],
    prefix: str,
    value: Callable[[list[str], str], Any],
    model_cls: type[BaseModel] | None = None,
) -> dict[str, Any]:
    """The `prefix` variables as a nested dict (`__` nests), each leaf `value(parts, raw)`; with
    `model_cls`, only those whose first level names one of its fields."""
    out: dict[str, Any] = {}
    for key, raw in sorted(environ.items()):
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix) :].lower().split(ENV_NESTING)
        if model_cls is not None and parts[0] not in model_cls.model_fields:
            continue
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value(parts, raw)
    return out


def _yaml_value(raw: str) -> Any:
    return yaml.safe_load(raw) if raw != "" else None


def _env_value(model_cls: type[BaseModel], parts: list[str], raw: str) -> Any:
    """`raw` as written for a field that holds text, else as YAML; empty is None."""
    if raw == "":
        return None
    annotation = _annotation_at(model_cls, parts)
    return raw if annotation is not None and _holds_text(annotation) else _yaml_value(raw)


def _annotation_at(model_cls: type[BaseModel], parts: list[str]) -> Any:
    """The annotation of the field at the dotted `parts` (through nested models); None when unknown."""
    annotation: Any = model_cls
    for part in parts:
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        field = annotation.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
    return annotation


def _holds_text(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _holds_text(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return any(_holds_text(arg) for arg in get_args(annotation))
    return isinstance(annotation, type) and issubclass(annotation, _TEXT_TYPES)
