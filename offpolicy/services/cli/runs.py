"""`offpolicy runs`: the runs of an actor pool (the actor's `/v1/runs`): list, add, update, remove.

Each verb makes one `ActorClient` call and prints the answer (`--json`: the API's JSON). The actor is
`--actor-url` (env `OFFPOLICY_ACTOR_URL`, default http://127.0.0.1:8001); the token, the exit codes and the
error lines are every verb's (verbs.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from offpolicy.services.cli.verbs import merge_patch, num, read_config_file, run_verb, table
from offpolicy.services.client import ActorClient

DEFAULT_ACTOR_URL = "http://127.0.0.1:8001"


def _list(client: ActorClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.runs()
    header = ["run_id", "state", "policy_version", "learner_version", "groups_pushed", "tokens/s", "share"]
    rows = [
        [
            r["run_id"],
            r["state"] + (f" ({r['error']})" if r.get("error") else ""),
            num(r["loaded_policy_version"]),
            num(r["learner_policy_version"]),
            str(r["groups_pushed"]),
            num(r["tokens_per_s"]),
            str(r["max_inflight_prompts"]),
        ]
        for r in out["runs"]
    ]
    return out, table(header, rows) if rows else ["no runs"]


def _add(client: ActorClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.add_run(read_config_file(args.file))
    return out, [f"run {out['run_id']} added: {out['state']}, share {out['max_inflight_prompts']} prompts"]


def _update(client: ActorClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.update_run(args.run_id, merge_patch(args.assignments))
    return out, [f"run {out['run_id']} updated: share {out['max_inflight_prompts']} prompts"]


def _remove(client: ActorClient, args: argparse.Namespace) -> tuple[Any, list[str]]:
    out = client.remove_run(args.run_id)
    return out, [f"run {out['run_id']} removed after {out['groups_pushed']} groups (its buffer keeps them)"]


def add_runs_parser(sub: argparse._SubParsersAction) -> None:
    """`offpolicy runs list|add|update|remove`, each with `--actor-url`, `--token` and `--json`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--actor-url", help=f"the actor service (env OFFPOLICY_ACTOR_URL; default {DEFAULT_ACTOR_URL})"
    )
    common.add_argument(
        "--token", help="bearer token for changes (env OFFPOLICY_TOKEN, then OFFPOLICY_API_TOKEN)"
    )
    common.add_argument("--json", action="store_true", help="print the API's JSON answer")
    runs = sub.add_parser("runs", help="the runs of an actor pool: several runs on one engine (LoRA)")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)

    def verb(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        parser = runs_sub.add_parser(name, parents=[common], help=help, description=help)
        parser.set_defaults(func=lambda args: _run(fn, args))
        return parser

    verb("list", _list, "every run the actor serves, its state and versions (GET /v1/runs)")
    add = verb("add", _add, "add a run from its config FILE, without restarting vLLM (POST /v1/runs)")
    add.add_argument("file", type=Path, metavar="FILE", help="a YAML or JSON run config (an ActorConfig)")
    update = verb(
        "update", _update, "change a run's max_inflight_prompts or sampling (PATCH /v1/runs/RUN_ID)"
    )
    update.add_argument("run_id", metavar="RUN_ID")
    update.add_argument("assignments", nargs="+", metavar="KEY=VALUE", help="e.g. sampling.temperature=0.8")
    remove = verb("remove", _remove, "stop a run and release its adapters (DELETE /v1/runs/RUN_ID)")
    remove.add_argument("run_id", metavar="RUN_ID")


def _run(fn: Any, args: argparse.Namespace) -> int:
    url = args.actor_url or os.environ.get("OFFPOLICY_ACTOR_URL") or DEFAULT_ACTOR_URL
    return run_verb(fn, args, ActorClient, url)
