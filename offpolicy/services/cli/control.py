"""The `offpolicy` verbs of the learner's control plane: status, config, pause, resume, checkpoint, ...

Each verb makes one `LearnerClient` call and prints the answer (`--json`: the API's JSON). The learner is
`--url` (env `OFFPOLICY_URL`, default http://127.0.0.1:8000); the token, the exit codes and the error lines
are every verb's (verbs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from offpolicy.services.cli.check import add_check_parser
from offpolicy.services.cli.verbs import UsageError, Verb, merge_patch, num, read_config_file, run_verb, table
from offpolicy.services.client import LearnerClient

DEFAULT_URL = "http://127.0.0.1:8000"
_BUFFER_KEYS = ("size", "max_size", "inserted_total", "sampled_total", "leases_outstanding", "held")
_STEP_KEYS = ("loss", "reward_mean", "lr", "grad_norm", "staleness_mean", "response_length_mean")


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
        f"tokens_per_s    {num(out['tokens_per_s'])}",
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
    return out, table(["version", "source", "submitted (UTC)", "applied_at_step", "changed"], rows)


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
    return out, table(["time (UTC)", "group_id", "reason", "field", "consumer"], rows) if rows else [
        "no dead letters"
    ]


def _change(out: dict[str, Any]) -> tuple[Any, list[str]]:
    changed = ", ".join(out["changed_fields"]) or "nothing"
    return out, [f"config_version {out['config_version']} {out['status']}: changed {changed}"]


# --- printing


def _value(value: Any) -> str:
    """A config value as the history prints it: compact JSON (`1e-06`, `"grpo"`, `[0.9, 0.99]`, `null`)."""
    return json.dumps(value, separators=(",", ":"))


def _pairs(values: dict[str, Any], keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={num(values[k])}" for k in keys if k in values) or "-"


def _time(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


def _run(fn: Verb, args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("OFFPOLICY_URL") or DEFAULT_URL
    return run_verb(fn, args, LearnerClient, url)


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
        parser.set_defaults(func=lambda args: _run(fn, args))
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
    add_check_parser(config_sub)  # offline: no learner called (check.py)
    verb(sub, "pause", _pause, "pause at the next step boundary (POST /v1/pause)")
    verb(sub, "resume", _resume, "resume a paused learner (POST /v1/resume)")
    verb(sub, "checkpoint", _checkpoint, "write a checkpoint now (POST /v1/checkpoints)")
    letters = verb(sub, "dead-letters", _dead_letters, "groups set aside as poison (GET /v1/dead_letters)")
    letters.add_argument("--limit", type=int, default=100, help="most entries, 1..1000 (default 100)")
