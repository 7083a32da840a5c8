"""Structured logging: one JSON object per line on stderr, for every service process."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from offpolicy.config.secrets import Redactor

# Attributes every LogRecord has; anything else was passed with `extra=` and goes into the JSON object.
_STANDARD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as `{"ts", "level", "logger", "msg", ...extra}`; exceptions under `exc`."""

    def __init__(self, redactor: Redactor | None = None) -> None:
        super().__init__()
        self.redactor = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return self.redactor.scrub(json.dumps(out, default=str))


class TextFormatter(logging.Formatter):
    """`time level logger: message` for humans at a terminal, secrets scrubbed."""

    def __init__(self, redactor: Redactor | None = None) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.redactor = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        return self.redactor.scrub(super().format(record))


def configure_logging(level: str = "info", json_lines: bool = True, redactor: Redactor | None = None) -> None:
    """Route the root logger (and uvicorn's) to stderr with the JSON (or text) formatter, every line
    scrubbed of `redactor`'s secrets; idempotent."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(redactor) if json_lines else TextFormatter(redactor))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    logging.Formatter.converter = time.gmtime
