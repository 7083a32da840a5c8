"""Config changes of the running learner: validation, the frozen-field rule, config versions and history.

The service accepts a new config (PUT = replace, PATCH = merge), validates it as a `LearnerConfig`,
refuses changes to fields marked `frozen_while_running` (`FrozenFieldChange`, 409), gives it the next
`config_version` and hands it to the learner, which switches at its next step boundary and reports back
through `mark_applied`. Every accepted config stays in the history with when it was submitted and applied.

Secrets: the history keeps the real config; what the routes show passes through `redacted` (the Redis
password masked). A body that carries the masked `redis_url` back (GET, edit, PUT) means the running one.
Path fields the learner writes while running (`writable_path`, e.g. `metrics_jsonl`) are checked before
a change is accepted: their folder must exist or be creatable, and be writable (422 otherwise).
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from offpolicy.config.loader import changed_fields
from offpolicy.config.secrets import redact_url
from offpolicy.learner.config import LearnerConfig, frozen_field_changes, merge, writable_path_fields
from offpolicy.learner.errors import FrozenFieldChange
from offpolicy.services.common.errors import InvalidConfig, field_errors
from offpolicy.services.learner_api.schemas import ConfigEntry, ConfigSource, FieldChange


def validate_body(body: Mapping[str, Any]) -> LearnerConfig:
    """`body` as a `LearnerConfig`; `InvalidConfig` with `body.`-prefixed field paths when it is not one
    (an unknown preset name in place of `rollout_correction` is one such field error)."""
    try:
        return LearnerConfig.model_validate(dict(body))
    except ValidationError as exc:
        raise InvalidConfig(
            f"{exc.error_count()} invalid field(s) in the config",
            field_errors(exc.errors(include_url=False), prefix=("body",)),
        ) from exc


def redacted_config(config: LearnerConfig) -> LearnerConfig:
    """`config` as the API shows it: `redis_url` with its password masked (a copy; not re-validated)."""
    return config.model_copy(update={"redis_url": redact_url(config.redis_url)})


def redacted(entry: ConfigEntry) -> ConfigEntry:
    """`entry` as the API shows it: its config through `redacted_config`."""
    return entry.model_copy(update={"config": redacted_config(entry.config)})


def with_changes(entries: list[ConfigEntry]) -> list[ConfigEntry]:
    """The history as the API shows it: each entry redacted, with the old and new value of each of its
    `changed_fields` (the old from the entry before it)."""
    shown = [redacted(e) for e in entries]
    out = shown[:1]
    for before, entry in itertools.pairwise(shown):
        old, new = before.config.model_dump(mode="json"), entry.config.model_dump(mode="json")
        changes = [FieldChange(field=f, old=_at(old, f), new=_at(new, f)) for f in entry.changed_fields]
        out.append(entry.model_copy(update={"changes": changes}))
    return out


def _at(values: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted `path` of a config dump; None where it has none (e.g. a mapping replaced by
    a preset name)."""
    value: Any = values
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _can_create_in(folder: str) -> bool:
    """Whether a file can be created in `folder`: tried for real (an anonymous temporary file, gone when
    closed), since permission bits say nothing for root and nothing about read-only or virtual filesystems."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def unwritable_paths(config: LearnerConfig, fields: list[str]) -> list[dict[str, str]]:
    """`FieldError`s for the `writable_path` fields among `fields` whose file cannot be written: a file
    must be creatable in the nearest existing ancestor of its folder, and the path must not be a folder."""
    errors = []
    for field in sorted(set(fields) & set(writable_path_fields())):
        value: Any = config
        for part in field.split("."):
            value = getattr(value, part)
        if value is None:
            continue
        folder = os.path.dirname(os.path.abspath(value))
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if os.path.isdir(value) or not _can_create_in(folder):
            errors.append(
                {
                    "field": f"body.{field}",
                    "message": f"{value!r} cannot be written: {folder!r} is not a writable folder "
                    "(or the path names a folder)",
                    "type": "path_not_writable",
                }
            )
    return errors


class ConfigControl:
    """The config history of one learner service and the rules for changing it; thread-safe."""

    def __init__(
        self,
        initial: LearnerConfig,
        apply: Callable[[LearnerConfig, int], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`apply(config, config_version)` hands an accepted config to the learner's next step boundary."""
        self._apply = apply
        self._clock = clock
        self._lock = threading.Lock()  # guards _entries
        self._change_lock = threading.Lock()  # one change at a time: versions dense, history ordered
        now = clock()
        self._entries = [
            ConfigEntry(
                config_version=0,
                source="initial",
                submitted_at=now,
                applied_at=now,
                applied_at_step=0,
                changed_fields=[],
                config=initial,
            )
        ]

    # --- reading

    def history(self) -> list[ConfigEntry]:
        with self._lock:
            return list(self._entries)

    def running(self) -> ConfigEntry:
        """The newest config the loop has switched to."""
        with self._lock:
            return next(e for e in reversed(self._entries) if e.applied_at is not None)

    def newest(self) -> ConfigEntry:
        """The newest accepted config (pending or running): PATCHes merge into this one."""
        with self._lock:
            return self._entries[-1]

    def pending_version(self) -> int | None:
        newest = self.newest()
        return None if newest.applied_at is not None else newest.config_version

    # --- resolving a request body into a config

    def resolve(self, body: Mapping[str, Any], mode: str) -> tuple[LearnerConfig, list[str]]:
        """The config a `replace` or `merge` body produces and the fields it changes; raises InvalidConfig
        (422) or FrozenFieldChange (409) exactly as a real change would."""
        base = self.newest().config.model_dump(mode="json")
        data = merge(base, body) if mode == "merge" else dict(body)
        running = self.running().config
        if data.get("redis_url") == redact_url(running.redis_url):
            data["redis_url"] = running.redis_url  # the masked form shown by GET means the running URL
        new = validate_body(data)
        frozen = frozen_field_changes(running, new)
        if frozen:
            raise FrozenFieldChange(frozen)
        changed = changed_fields(base, new.model_dump(mode="json"))
        bad_paths = unwritable_paths(new, changed)
        if bad_paths:
            raise InvalidConfig(f"{len(bad_paths)} path(s) the learner could not write", bad_paths)
        return new, changed

    # --- changing

    def submit(self, body: Mapping[str, Any], mode: str, source: ConfigSource) -> ConfigEntry:
        """Validate, version and hand over a change; the learner applies it at its next step boundary."""
        with self._change_lock:
            new, changed = self.resolve(body, mode)
            entry = ConfigEntry(
                config_version=self.newest().config_version + 1,
                source=source,
                submitted_at=self._clock(),
                applied_at=None,
                applied_at_step=None,
                changed_fields=changed,
                config=new,
            )
            with self._lock:  # handed over first: a refusal (NotReady, 409) leaves no entry behind
                self._apply(new, entry.config_version)
                self._entries.append(entry)
        return entry

    def record_resume(self, config: LearnerConfig, step: int, changed: list[str], detail: str) -> None:
        """The learner resumed a checkpoint and runs `config` (learner/config/resume.py): version 1,
        source `resume`, applied at the checkpoint's `step`; `changed` = where the file disagreed."""
        now = self._clock()
        entry = ConfigEntry(
            config_version=self.newest().config_version + 1,
            source="resume",
            submitted_at=now,
            applied_at=now,
            applied_at_step=step,
            changed_fields=changed,
            config=config,
            detail=detail,
        )
        with self._lock:
            self._entries.append(entry)

    def mark_applied(self, config_version: int, step: int) -> None:
        """The learner's `on_config_applied`: called from its loop at the step boundary where
        `config_version` took effect, `step` = learner steps completed before it.

        Earlier pending versions that were superseded before a boundary are marked applied at the same
        boundary (they never ran a step, but their changes are contained in the newer one)."""
        now = self._clock()
        with self._lock:
            for i, entry in enumerate(self._entries):
                if entry.applied_at is None and entry.config_version <= config_version:
                    self._entries[i] = entry.model_copy(update={"applied_at": now, "applied_at_step": step})
