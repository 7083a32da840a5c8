"""Which config a resumed learner runs: the checkpoint's (the run's applied changes survive) or the file's.

Every checkpoint's `meta.json` holds the config the learner trained with when it was taken and its
`config_version` (learner/persist/checkpoint.py). At resume, `checkpoint.resume_config` (read from the
file) decides:

- `checkpoint` (the default): the run goes on as it was. Every field that may change while running (the
  optimizer, the rollout correction, the buffer, ...) takes the checkpoint's value; the fields frozen while
  running (the model, the Redis URL and run, the folders, the trackers), `metrics_jsonl` and
  `checkpoint.resume_config` itself come from the file, since they describe where this process runs,
  not what it learns.
- `file`: the file wins for every field: a deliberate edit of the file before a restart takes effect.

Either way the fields where the file and the checkpoint disagree are reported: a warning in the log and the
`resume` entry of the config history (`changed_fields`, `detail`). A checkpointed config that no longer
validates (a key renamed since) is reported too and the file's is used.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from offpolicy.config.loader import changed_fields
from offpolicy.learner.config import LearnerConfig, frozen_field_changes, frozen_field_paths

log = logging.getLogger(__name__)

FROM_FILE = ("redis_url", "checkpoint.resume_config", "metrics_jsonl")
"""Taken from the file whatever the rule, beside the frozen fields (the checkpoint's `redis_url` is
redacted; the rule is the file's by definition; `metrics_jsonl` is where this process writes, which a
restart may move)."""


@dataclass(frozen=True)
class ResumedConfig:
    """The config a resumed learner runs and how it came about (the service's `resume` history entry)."""

    config: LearnerConfig
    saved_version: int
    """The `config_version` the checkpoint was taken at (0: the config the run started with)."""
    disagreeing: list[str]
    """Dotted paths where the file and the checkpoint disagree (fields frozen while running excluded)."""
    detail: str


def _leaf(data: dict[str, Any], path: str) -> tuple[dict[str, Any], str] | None:
    parts = path.split(".")
    for part in parts[:-1]:
        data = data.get(part)
        if not isinstance(data, dict):
            return None
    return data, parts[-1]


def _take(target: dict[str, Any], source: dict[str, Any], path: str) -> None:
    """target[path] = source[path] (dotted) where both have the parent."""
    src, dst = _leaf(source, path), _leaf(target, path)
    if src is not None and dst is not None and src[1] in src[0]:
        dst[0][dst[1]] = copy.deepcopy(src[0][src[1]])


def resumed_config(file: LearnerConfig, meta: dict[str, Any]) -> ResumedConfig:
    """The config to run after resuming a checkpoint whose `meta.json` is `meta`, `file` being the config
    this process was started with (see the module doc for the rule)."""
    saved, saved_version = meta.get("config"), int(meta.get("config_version", 0))
    file_data = file.model_dump(mode="json")
    if not isinstance(saved, dict):
        return ResumedConfig(file, saved_version, [], "the checkpoint holds no config: the file's is used")
    data = copy.deepcopy(saved)
    for path in [*frozen_field_paths(), *FROM_FILE]:
        _take(data, file_data, path)
    try:
        candidate = LearnerConfig.model_validate(data)
    except ValidationError as exc:
        fields = sorted({".".join(str(p) for p in e["loc"]) for e in exc.errors(include_url=False)})
        detail = f"the checkpoint's config no longer validates ({', '.join(fields)}): the file's is used"
        log.warning("resume: %s", detail)
        return ResumedConfig(file, saved_version, [], detail)
    if frozen_field_changes(file, candidate):  # the critic / reference cannot appear or vanish
        detail = "the checkpoint's config needs another model layout (critic, reference): the file's is used"
        log.warning("resume: %s", detail)
        return ResumedConfig(file, saved_version, [], detail)
    saved_data = candidate.model_dump(mode="json")
    disagreeing = changed_fields(file_data, saved_data)
    rule = file.checkpoint.resume_config
    if not disagreeing:
        detail = f"reapplied config version {saved_version} of the checkpoint; the file agrees with it"
        return ResumedConfig(candidate, saved_version, [], detail)
    if rule == "checkpoint":
        detail = (
            f"reapplied config version {saved_version} of the checkpoint; it overrides the file's "
            f"{_values(disagreeing, file_data, saved_data)} (checkpoint.resume_config: checkpoint; to run "
            "the file's values instead, restart with checkpoint.resume_config: file, or PATCH them now)"
        )
        chosen = candidate
    else:
        detail = (
            f"the file replaces the checkpoint's (config version {saved_version}) "
            f"{_values(disagreeing, file_data, saved_data)} (checkpoint.resume_config: file; to go on with "
            "the run's own values, restart with checkpoint.resume_config: checkpoint)"
        )
        chosen = file
    log.warning("resume: %s", detail)
    return ResumedConfig(chosen, saved_version, disagreeing, detail)


SHOWN = 8
"""Disagreeing fields whose two values the resume message shows (the rest by name)."""


def _values(paths: list[str], file: dict[str, Any], saved: dict[str, Any]) -> str:
    """`path` (file X, checkpoint Y) for the first `SHOWN` paths, the others by name."""

    def value(data: dict[str, Any], path: str) -> Any:
        leaf = _leaf(data, path)
        return leaf[0].get(leaf[1]) if leaf is not None else None

    shown = [f"{p} (file {value(file, p)!r}, checkpoint {value(saved, p)!r})" for p in paths[:SHOWN]]
    rest = f" and {', '.join(paths[SHOWN:])}" if paths[SHOWN:] else ""
    return ", ".join(shown) + rest
