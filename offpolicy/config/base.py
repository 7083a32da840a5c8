"""`ConfigModel`, the strict frozen base of every config model, and the bounded string types.

Every config of every process (learner, buffer, rollout correction, actor, service settings) derives from
`ConfigModel`, so one set of rules holds for all of them, whatever door a value comes through (YAML, the
environment, a REST body):

- frozen, `extra="forbid"`, the docstring under each field is its description;
- floats are finite: NaN, ±inf and overflowing literals (`1e309`, JSON `Infinity`) are refused;
- a boolean is not a number: `true` for a field that does not admit `bool` is refused (pydantic's lax
  mode would read it as 1); ints refuse floats with a fraction (pydantic's own rule);
- strings are at most `MAX_STR` characters; ids and paths have the tighter types below;
- a key that was renamed or merged into another (`renamed_keys`) is refused with a message naming the new
  one, instead of pydantic's bare "extra inputs are not permitted".
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_STR = 4096
"""Longest string any config field holds, in characters (PATH_MAX on Linux)."""
FROZEN = {"frozen_while_running": True}
"""`json_schema_extra` of a field that cannot change while a learner's loop runs (the REST API answers 409
naming it: learner/config.py `frozen_field_changes`)."""
MAX_ID = 128
"""Longest id (run id, actor id), in characters."""
MAX_PATH_COMPONENT = 255
"""Longest path component, in bytes (NAME_MAX on Linux): a longer one fails at `open` ("File name too
long"), so it is refused when the config is built, not when the loop first writes."""

# Upper bounds of the numbers a config holds that spend something (time, memory, engine or disk room):
# wide enough for any cluster run, there to refuse a typo or a hostile value with the field and the limit
# (tests/unit/config/test_bounds.py walks every config model for a number without one).
MAX_WAIT_S = 86_400.0
"""The longest timeout, wait or period in seconds: a day."""
MAX_AGE_S = 366 * 86_400.0
"""The longest age a window keeps, in seconds: a year."""
MAX_COUNT = 10**9
"""A count of groups, steps, versions or entries (buffer sizes, windows, intervals): a billion."""
MAX_BATCH = 65_536
"""Groups in a step or a mini-batch, sequences in a micro-batch, ranks, actors, threads."""
MAX_ATTEMPTS = 1_000
"""Attempts, rounds and epochs of one thing."""
MAX_SEQ_TOKENS = 2**24
"""Tokens of one sequence, context or micro-batch budget (16M)."""
MAX_BYTES = 2**50
"""A byte budget (1 PiB)."""
MAX_KEEP = 10_000
"""Copies kept on disk (weight versions, checkpoints)."""


class ConfigModel(BaseModel):
    """Frozen, closed, finite, bool-is-not-a-number, bounded strings (module docstring)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        str_max_length=MAX_STR,
        use_attribute_docstrings=True,
    )
    renamed_keys: ClassVar[Mapping[str, str]] = {}
    """Keys this model no longer has, each with the message that names what replaced it."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key in cls.renamed_keys.keys() & data.keys():
                raise ValueError(f"{key!r} is no longer a setting: {cls.renamed_keys[key]}")
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _bool_is_not_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is not None and _holds_bool(value) and not _admits_bool(cls, info.field_name):
            raise ValueError(f"{value!r}: a boolean is not a valid value here")
        return value


def _holds_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, list | tuple) and any(isinstance(v, bool) for v in value)


@cache
def _admits_bool(cls: type[BaseModel], field: str) -> bool:
    info = cls.model_fields.get(field)
    return info is None or _mentions_bool(info.annotation)


def _mentions_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _mentions_bool(get_args(annotation)[0])
    if origin in (Union, types.UnionType, list, tuple):
        return any(_mentions_bool(arg) for arg in get_args(annotation) if arg is not Ellipsis)
    return False


def _check_path(value: str) -> str:
    if "\x00" in value:
        raise ValueError("a path cannot contain a NUL character")
    for part in value.split("/"):
        if len(part.encode()) > MAX_PATH_COMPONENT:
            raise ValueError(
                f"path component {part[:40]!r}... is {len(part.encode())} bytes long; "
                f"the limit is {MAX_PATH_COMPONENT}"
            )
    return value


PathStr = Annotated[str, Field(min_length=1, max_length=MAX_STR), AfterValidator(_check_path)]
"""A filesystem path: 1..4096 characters, no NUL, no component over 255 bytes."""

IdStr = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
"""An identifier (actor id, experiment name): 1..128 characters."""

RUN_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
"""What a run id may hold: it names the run's Redis keys (their hash tag: no braces) and its folders."""
_RUN_ID = re.compile(RUN_ID_PATTERN)


def check_run_id(value: str) -> str:
    """`value` when it is a run id (`RUN_ID_PATTERN`, and not `.` or `..`, which as a folder name leave
    the runs' root), else ValueError saying what a run id is."""
    if not _RUN_ID.match(value) or value in (".", ".."):
        raise ValueError(
            f"run_id {value[:40]!r}: 1-128 characters of A-Z a-z 0-9 _ . : - (it names the run's Redis keys "
            "and folders), not '.' or '..'"
        )
    return value


RunId = Annotated[
    str, Field(min_length=1, max_length=MAX_ID, pattern=RUN_ID_PATTERN), AfterValidator(check_run_id)
]
"""A run id, the one type of every boundary that takes one (configs, REST bodies, the buffer's keys)."""
