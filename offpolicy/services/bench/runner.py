"""Runs benchmarks/<name>.py `repeats` times with `--json` and writes their record; checks the targets.

Each repeat is its own process (a benchmark's start-up, its engines' and compilers' warm-up are inside a
repeat, as a user's run would have them); the record keeps each repeat's whole JSON object, so a figure is
never only a median. A repeat that fails stops the run: its exit code and the tail of its stderr are
printed, and nothing is recorded (a record never mixes runs that ended differently).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offpolicy.services.bench.records import (
    Record,
    git_state,
    loadavg,
    new_record,
    timed_repeat,
    write_record,
)
from offpolicy.services.bench.targets import TARGETS, Target, newest, targets_of

BENCHMARKS = (
    "correction", "buffer", "learner", "learner_fsdp", "publish_gather", "actor", "reward_latency", "e2e",
    "staleness", "weight_sync", "weight_sync_engine", "agent", "memory_plan", "lora", "learning_signal",
    "learner_traffic", "moe", "control", "weight_delta", "vision",
)  # fmt: skip
"""What `offpolicy bench` runs when no name is given (the soak, `--minutes` long, runs only by name)."""


class BenchmarkFailed(RuntimeError):
    """A repeat exited non-zero or printed no JSON object."""


@dataclass(frozen=True)
class Run:
    """One benchmark's run: its record (written or not) and the path it went to."""

    record: Record
    written: bool


def script_path(root: Path, name: str) -> Path:
    path = root / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"benchmarks/{name}.py does not exist")
    return path


def _json_tail(stdout: str, name: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise BenchmarkFailed(f"{name}: printed nothing")
    try:
        out = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise BenchmarkFailed(f"{name}: the last line is not JSON ({e}): {lines[-1][:200]!r}") from e
    if not isinstance(out, dict):
        raise BenchmarkFailed(f"{name}: the last line is a {type(out).__name__}, not an object")
    return out


def run_benchmark(
    root: Path,
    name: str,
    args: list[str],
    *,
    repeats: int,
    smoke: bool,
    results_dir: Path | None,
    timeout_s: float | None = None,
    note: str | None = None,
) -> Run:
    """`python benchmarks/<name>.py --json [--smoke] ARGS`, `repeats` times; the record (written under
    `results_dir` unless it is None)."""
    script = script_path(root, name)
    command = [sys.executable, str(script.relative_to(root)), "--json", *(["--smoke"] * smoke), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    def once() -> dict[str, Any]:
        try:
            done = subprocess.run(
                command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as e:
            raise BenchmarkFailed(f"{name}: did not finish in {timeout_s:.0f} s") from e
        if done.returncode != 0:
            raise BenchmarkFailed(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
        return _json_tail(done.stdout, name)

    before, git_before = loadavg(), git_state(root)
    results = [timed_repeat(once) for _ in range(repeats)]
    data = new_record(
        name,
        args,
        command,
        smoke=smoke,
        root=root,
        repeats=results,
        load_before=before,
        load_after=loadavg(),
        note=note,
        git_before=git_before,
    )
    path = None if results_dir is None else write_record(results_dir, data)
    return Run(Record(path or Path(f"{data['id']}.json"), data), written=path is not None)


def check_record(record: Record, targets: list[Target] | None = None) -> list[dict[str, Any]]:
    """Each of the record's benchmark's targets judged on it (a CUDA target on a CPU record: `absent`)."""
    verdicts = []
    on_gpu = bool(record.data.get("machine", {}).get("gpus"))
    for target in targets if targets is not None else targets_of(record.benchmark):
        verdict = target.verdict(record)
        if target.device == "cuda" and not on_gpu and verdict["status"] != "absent":
            verdict = {**verdict, "status": "not judged", "why": "a CUDA target measured without a GPU"}
        verdicts.append(verdict)
    return verdicts


def check_records(records: list[Record]) -> list[dict[str, Any]]:
    """Every target judged on its newest full-run record (status `no record` where there is none)."""
    verdicts = []
    for target in TARGETS:
        record = newest(records, target)
        if record is None:
            verdicts.append({"target": target.name, "status": "no record", "n": 0})
        else:
            verdicts.extend(check_record(record, [target]))
    return verdicts
