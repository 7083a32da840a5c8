"""The `offpolicy` verbs of the learner's control plane: status, config, pause, resume, checkpoint, ...

Each verb makes one `LearnerClient` call and prints the answer: a few lines or a small table for people,
the API's JSON with `--json` for scripts. The learner is `--url` (env `OFFPOLICY_URL`, default
http://127.0.0.1:8000); the bearer token is `--token` (env `OFFPOLICY_TOKEN`, then `OFFPOLICY_API_TOKEN`)
and is never printed. Exit codes: 0 done, 2 the service refused (every API error, shown with its status,
code and each field path) or the command line / file was wrong, 1 the service could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from offpolicy.services.cli_check import add_check_parser
from offpolicy.services.client import ClientError, LearnerClient, ServiceClient, Unreachable

DEFAULT_URL = "http://127.0.0.1:8000"
REFUSED, UNREACHABLE = 2, 1
_BUFFER_KEYS = ("size", "max_size", "inserted_total", "sampled_total", "leases_outstanding", "held")
_STEP_KEYS = ("loss", "reward_mean", "lr", "grad_norm", "staleness_mean", "response_length_mean")


class UsageError(Exception):
    """A bad argument or file, found before anything is sent."""


# --- the verbs: one client call each, then what to print


def _status(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.status()
    pending = out["pending_config_version"]
    lines = [
        f"state           {out['state']}" + (f" ({out['error']})" if out.get("error") else ""),
        f"step            {out['step']}",
        f"policy_version  {out['policy_version']}",
        f"config_version  {out['config_version']}" + (f" (pending {pending})" if pending is not None else ""),
        f"world_size      {out['world_size']}",
        f"tokens_per_s    {_num(out['tokens_per_s'])}",
        f"buffer          {_pairs(out['buffer'], _BUFFER_KEYS)}",
        f"last_step       {_pairs(out['last_step'], _STEP_KEYS)}",
    ]
    return out, lines


def _config_get(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.config()
    if args.key is None:
        head = (
            f"# config_version {out['config_version']} ({out['source']}), "
            f"applied at step {out['applied_at_step']}"
        )
        return out, [head, yaml.safe_dump(out["config"], sort_keys=False).rstrip()]
    value: Any = out["config"]
    for part in args.key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise UsageError(f"config get: no key {args.key!r} in the running config")
        value = value[part]
    if isinstance(value, dict | list):
        return value, [yaml.safe_dump(value, sort_keys=False).rstrip()]
    return value, [value if isinstance(value, str) else json.dumps(value)]  # true, null, 0.001


def _config_set(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    return _change(client.patch_config(merge_patch(args.assignments)))


def _config_apply(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    return _change(client.put_config(read_config_file(args.file)))


def _config_validate(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    mode = "merge" if args.merge else "replace"
    out = client.validate_config(read_config_file(args.file), mode)
    changed = ", ".join(out["changed_fields"]) or "nothing"
    return out, [f"valid ({mode}); it would change: {changed}"]


def _config_history(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.config_history()
    rows = []
    for e in out["entries"]:
        changes = [f"{c['field']}: {_value(c['old'])} -> {_value(c['new'])}" for c in e["changes"]] or ["-"]
        applied = "pending" if e["applied_at_step"] is None else str(e["applied_at_step"])
        rows.append([str(e["config_version"]), e["source"], _time(e["submitted_at"]), applied, changes[0]])
        rows += [["", "", "", "", change] for change in changes[1:]]  # one line per changed key
    return out, _table(["version", "source", "submitted (UTC)", "applied_at_step", "changed"], rows)


def _pause(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.pause()
    return out, [f"state {out['state']} (step {out['step']}, policy_version {out['policy_version']})"]


def _resume(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.resume()
    return out, [f"state {out['state']} (step {out['step']}, policy_version {out['policy_version']})"]


def _checkpoint(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.checkpoint()
    return out, [f"checkpoint of policy_version {out['policy_version']} written to {out['path']}"]


def _dead_letters(client: LearnerClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.dead_letters(args.limit)
    rows = [
        [_time(e["time_ms"] / 1000), e["group_id"], e["reason"], e["field"], e["consumer"]]
        for e in out["entries"]
    ]
    return out, _table(["time (UTC)", "group_id", "reason", "field", "consumer"], rows) if rows else [
        "no dead letters"
    ]


def _change(out: dict[str, Any]) -> tuple[Any, list[str]]:
    changed = ", ".join(out["changed_fields"]) or "nothing"
    return out, [f"config_version {out['config_version']} {out['status']}: changed {changed}"]


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
    0.28}`: one merge-patch body for `PATCH /v1/config`."""
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


def _value(value: Any) -> str:
    """A config value as the history prints it: compact JSON (`1e-06`, `"grpo"`, `[0.9, 0.99]`, `null`)."""
    return json.dumps(value, separators=(",", ":"))


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _pairs(values: dict[str, Any], keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={_num(values[k])}" for k in keys if k in values) or "-"


def _time(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


# --- running a verb


Verb = Callable[[Any, argparse.Namespace], tuple[Any, list[str]]]


def run_verb(
    verb: Verb,
    args: argparse.Namespace,
    client_cls: type[ServiceClient] = LearnerClient,
    url: str | None = None,
) -> int:
    """Call the service (`client_cls` at `url`; the learner at `--url` by default), print the answer; the
    exit code (see the module docstring)."""
    url = url or args.url or os.environ.get("OFFPOLICY_URL") or DEFAULT_URL
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


def add_control_parsers(sub: argparse._SubParsersAction) -> None:
    """The control-plane subcommands, each with `--url`, `--token` and `--json`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the learner service (env OFFPOLICY_URL; default {DEFAULT_URL})")
    common.add_argument(
        "--token", help="bearer token for changes (env OFFPOLICY_TOKEN, then OFFPOLICY_API_TOKEN)"
    )
    common.add_argument("--json", action="store_true", help="print the API's JSON answer")

    def verb(parent: argparse._SubParsersAction, name: str, fn: Verb, help: str) -> argparse.ArgumentParser:
        parser = parent.add_parser(name, parents=[common], help=help, description=help)
        parser.set_defaults(func=lambda args: run_verb(fn, args))
        return parser

    verb(sub, "status", _status, "what the learner is doing (GET /v1/status)")
    config = sub.add_parser("config", help="read, change, validate the running learner's config")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    get = verb(config_sub, "get", _config_get, "the running config, or one dotted KEY (GET /v1/config)")
    get.add_argument("key", nargs="?", metavar="KEY", help="a dotted key, e.g. optimizer.lr")
    put = verb(
        config_sub, "set", _config_set, "change dotted keys, applied at the next step (PATCH /v1/config)"
    )
    put.add_argument("assignments", nargs="+", metavar="KEY=VALUE", help="values as JSON or YAML scalars")
    apply = verb(config_sub, "apply", _config_apply, "replace the whole config by FILE (PUT /v1/config)")
    apply.add_argument("file", type=Path, metavar="FILE", help="a YAML or JSON LearnerConfig")
    check = verb(
        config_sub, "validate", _config_validate, "check FILE without applying (POST /v1/config/validate)"
    )
    check.add_argument("file", type=Path, metavar="FILE", help="a YAML or JSON LearnerConfig")
    check.add_argument("--merge", action="store_true", help="FILE is a patch (as `config set`), not a whole")
    verb(
        config_sub,
        "history",
        _config_history,
        "every config version and each changed key's old -> new value (GET /v1/config/history)",
    )
    add_check_parser(config_sub)  # offline: no learner called (cli_check.py)
    verb(sub, "pause", _pause, "pause at the next step boundary (POST /v1/pause)")
    verb(sub, "resume", _resume, "resume a paused learner (POST /v1/resume)")
    verb(sub, "checkpoint", _checkpoint, "write a checkpoint now (POST /v1/checkpoints)")
    letters = verb(sub, "dead-letters", _dead_letters, "groups set aside as poison (GET /v1/dead_letters)")
    letters.add_argument("--limit", type=int, default=100, help="most entries, 1..1000 (default 100)")
