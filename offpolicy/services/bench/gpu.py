"""`offpolicy bench --gpu`: the one GPU run, every stage writing its record, in about 12 minutes on an H200.

Stages, in order (each under its own time limit, so a slow one cannot eat the others' time):

    tests     `pytest -m "gpu and not slow" tests/gpu` (what `make test-gpu SYSTEM=1` runs, less the slow
              ones): a record of benchmark `gpu_tests` with passed / failed / skipped and each failure's name
    4b        benchmarks/learner.py --shape longtail-4b --device cuda --steps 3 --profile: the long-tailed
              batch at full scale with today's defaults (compiled layers, the plan's checkpointing and
              budgets), 3 measured steps after a warm-up, one more under the profiler; the memory plan
              (`plan_gib`) beside the measured peak (`peak_memory_gib`)
    1.3b      the same for the Llama-shaped 1.78B
    4b-eager  the 4B with `--compile-layers off` and today's plan: what compiling is worth on its own
    moe       the Qwen3-30B-A3B-shaped stack (`--shape longtail-moe`), where the script has that shape

`--stages 4b,1.3b` runs some of them (the device tool gives a command at most 10 minutes: run the tests and
the figures as two calls when needed). A stage that fails is reported and the next one runs; the exit code
is 1 if any failed. Nothing here is CPU-testable beyond its plan (`--dry-run`) and the record plumbing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offpolicy.services.bench.records import loadavg, new_record, write_record
from offpolicy.services.bench.runner import BenchmarkFailed, run_benchmark
from offpolicy.services.children import REPO_ROOT


@dataclass(frozen=True)
class Stage:
    name: str
    benchmark: str
    args: tuple[str, ...]
    timeout_s: float


STAGES: tuple[Stage, ...] = (
    Stage("tests", "gpu_tests", ("-m", "gpu and not slow", "tests/gpu"), 180),
    Stage("4b", "learner", ("--shape", "longtail-4b", "--device", "cuda", "--steps", "3", "--profile"), 180),
    Stage("1.3b", "learner", ("--shape", "longtail-1.3b", "--device", "cuda", "--steps", "3"), 100),
    Stage("4b-eager", "learner", ("--shape", "longtail-4b", "--device", "cuda", "--steps", "3",
                                  "--compile-layers", "off"), 140),
    Stage("moe", "learner", ("--shape", "longtail-moe", "--device", "cuda", "--steps", "3"), 120),
)  # fmt: skip


def junit_counts(path: Path) -> dict[str, Any]:
    """passed / failed / errors / skipped and the failing tests' ids, from pytest's junit XML (ours)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None:
                counts["failed"] += 1
                counts["failures"].append(name)
            elif case.find("error") is not None:
                counts["errors"] += 1
                counts["failures"].append(name)
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def run_tests(stage: Stage, root: Path, results: Path | None) -> dict[str, Any]:
    """The GPU tests as a record of `gpu_tests` (its one repeat's output: the counts)."""
    before, t0 = loadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *stage.args,
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
        ]
        try:
            done = subprocess.run(cmd, cwd=root, timeout=stage.timeout_s, check=False, text=True)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = None
        counts = junit_counts(xml) if xml.exists() else {"tests": 0, "failures": []}
    output = {**counts, "exit_code": code, "timed_out": code is None}
    wall = round(time.perf_counter() - t0, 1)
    repeat = {"wall_s": wall, "loadavg_before": before, "loadavg_after": loadavg(), "output": output}
    data = new_record(stage.benchmark, list(stage.args), cmd, smoke=False, root=root, repeats=[repeat],
                      load_before=before, load_after=loadavg())  # fmt: skip
    if results is not None:
        write_record(results, data)
    if code != 0:
        raise BenchmarkFailed(f"gpu tests: exit {code}, failures {output.get('failures')}")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--stages", default=",".join(s.name for s in STAGES), help="comma-separated stages")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    args = parser.parse_args(argv)
    wanted = args.stages.split(",")
    unknown = set(wanted) - {s.name for s in STAGES}
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; known: {[s.name for s in STAGES]}")
    stages = [s for s in STAGES if s.name in wanted]
    print(f"[gpu] {len(stages)} stages, at most {sum(s.timeout_s for s in stages) / 60:.1f} min", flush=True)
    failed = []
    for stage in stages:
        print(f"[gpu] {stage.name}: {stage.benchmark} {' '.join(stage.args)} (limit {stage.timeout_s:.0f} s)")
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        try:
            if stage.benchmark == "gpu_tests":
                out = run_tests(stage, REPO_ROOT, args.results_dir)
                print(f"[gpu] tests: {out['passed']} passed, {out['skipped']} skipped", flush=True)
            else:
                run = run_benchmark(REPO_ROOT, stage.benchmark, list(stage.args), repeats=1, smoke=False,
                                    results_dir=args.results_dir, timeout_s=stage.timeout_s)  # fmt: skip
                print(f"[gpu] {stage.name}: record {run.record.id}", flush=True)
        except (BenchmarkFailed, FileNotFoundError) as e:
            print(f"[gpu] {stage.name} FAILED after {time.perf_counter() - t0:.0f} s: {e}", flush=True)
            failed.append(stage.name)
    if failed:
        print(f"[gpu] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
