"""What every service verb of the `offpolicy` command shares: one client call, its exit code and error lines.

A verb (`control.py`'s on the learner, `runs.py`'s on an actor pool) makes one client call and prints the
answer: a few lines or a small table for people, the API's JSON with `--json` for scripts. The bearer
token is `--token` (env `OFFPOLICY_TOKEN`, then `OFFPOLICY_API_TOKEN`) and is never printed. Exit codes: 0
done, 2 the service refused (every API error, shown with its status, code and each field path) or the
command line / file was wrong, 1 the service could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from offpolicy.services.client import ClientError, ServiceClient, Unreachable

REFUSED, UNREACHABLE = 2, 1


class UsageError(Exception):
    """A bad argument or file, found before anything is sent."""


# --- parsing what the user gives


def parse_value(text: str) -> Any:
    """A value of `KEY=VALUE`: JSON when it parses as JSON (`1e-5`, `[0.9, 0.99]`, `{"a": 1}`), else a
    YAML scalar or flow collection (`decoupled_seq_is`, `yes`, `[a, b]`); empty is null."""
    if text == "":
        return None
    try:
        return json.loads(text)
    except ValueError:
        return yaml.safe_load(text)


def merge_patch(assignments: list[str]) -> dict[str, Any]:
    """`["optimizer.lr=1e-5", "clip_ratio_high=0.28"]` → `{"optimizer": {"lr": 1e-5}, "clip_ratio_high":
    0.28}`: one merge-patch body for `PATCH /v1/config` (or `PATCH /v1/runs/RUN_ID`)."""
    patch: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        if not sep or not all(parts):
            raise UsageError(f"config set: {item!r} is not KEY=VALUE (a dotted KEY, e.g. optimizer.lr=1e-5)")
        node = patch
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"config set: {key!r} goes inside a key that is already given a value")
        if parts[-1] in node:
            raise UsageError(f"config set: {key!r} is given twice")
        node[parts[-1]] = parse_value(raw)
    return patch


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML or JSON file whose top level is a mapping."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


# --- printing


def error_lines(e: ClientError) -> list[str]:
    """`error 422 validation_error: body.optimizer.lr: Input should be greater than 0`, one line per
    bad field; other errors in one line with their message."""
    head = f"error {e.status} {e.code}"
    if (
        isinstance(e.detail, list)
        and e.detail
        and all(isinstance(d, dict) and "field" in d for d in e.detail)
    ):
        return [f"{head}: {d['field']}: {d.get('message', '')}" for d in e.detail]
    return [f"{head}: {e.message}"]


def num(value: Any) -> str:
    """A number as the tables print it: `-` for None, 4 significant digits for a float."""
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """`header` and `rows` as lines of left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


# --- running a verb


Verb = Callable[[Any, argparse.Namespace], tuple[Any, list[str]]]


def run_verb(verb: Verb, args: argparse.Namespace, client_cls: type[ServiceClient], url: str) -> int:
    """Call the service (`client_cls` at `url`), print the answer; the exit code (see the module
    docstring)."""
    token = args.token or os.environ.get("OFFPOLICY_TOKEN") or os.environ.get("OFFPOLICY_API_TOKEN")
    try:
        with client_cls(url, token=token or None) as client:
            out, lines = verb(client, args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return REFUSED
    except Unreachable as e:
        print(f"error: {client_cls.what} at {url} cannot be reached ({e})", file=sys.stderr)
        return UNREACHABLE
    except ClientError as e:
        if args.json:
            error = {"status": e.status, "code": e.code, "message": e.message, "detail": e.detail}
            print(json.dumps({"error": error}, indent=2))
        print("\n".join(error_lines(e)), file=sys.stderr)
        return REFUSED
    print(json.dumps(out, indent=2) if args.json else "\n".join(lines))
    return 0
