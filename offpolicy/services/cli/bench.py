"""`offpolicy bench`: run benchmarks into records, judge the targets, render docs/benchmarks.md, the GPU run.

    offpolicy bench [NAME ...] [--args="..."] [--repeats 3]   run, write a record each (all but the soak)
    offpolicy bench --check                                    judge every target on its newest record
    offpolicy bench --check NAME ... | --check --smoke         run them, then judge their targets
    offpolicy bench --report [--verify]                        docs/benchmarks.md from the records
    offpolicy bench --gpu                                      the one GPU run (--args="--stages 4b,1.3b")

`--check` exits 1 naming each missed target (and each target without a record, or whose figure a run did
not print). Under `--smoke` the sizes are too small for a verdict: a smoke check fails only when a
benchmark fails or does not print a target's figure; met / missed is shown, marked "smoke".
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from offpolicy.services.bench.records import read_records
from offpolicy.services.bench.report import render, write_report
from offpolicy.services.bench.runner import (
    BENCHMARKS,
    BenchmarkFailed,
    check_record,
    check_records,
    run_benchmark,
)
from offpolicy.services.bench.targets import TARGETS, Target, options
from offpolicy.services.children import REPO_ROOT

SHAPE_OPTIONS = ("--shape", "--device", "--nproc", "--nnodes", "--scale", "--transport")
"""The options that pick a figure's code path: a smoke run checks the targets whose values it shares."""


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="run the benchmarks into records, judge the targets (--check), render docs/benchmarks.md "
        "(--report), the GPU run (--gpu)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = bench.add_argument
    add("names", nargs="*", metavar="NAME", help=f"benchmarks/<NAME>.py (default: {' '.join(BENCHMARKS)})")
    add("--args", default="", help="the script's arguments besides --json (one NAME only)")
    add("--repeats", type=int, default=None, help="runs of each script (default 3; --smoke: 1)")
    add("--smoke", action="store_true", help="tiny sizes (the scripts' --smoke); records not committed")
    add("--check", action="store_true", help="judge the targets; exit 1 naming each missed one")
    add("--report", action="store_true", help="write docs/benchmarks.md from the records")
    add("--verify", action="store_true", help="with --report: write nothing, exit 1 if it would change")
    add("--gpu", action="store_true", help="the one GPU run: GPU tests and figures, into records")
    add("--results-dir", type=Path, default=None, help="where records go (default benchmarks/results)")
    add("--no-record", action="store_true", help="run without writing a record")
    add("--timeout-s", type=float, default=None, help="each repeat's wall-clock limit")
    add("--json", action="store_true", help="one JSON object as the last line (runs, verdicts)")
    bench.set_defaults(func=run_bench)


def _applies(target: Target, args: list[str], smoke: bool) -> bool:
    """Whether a run with `args` prints `target`'s figure: same code path (SHAPE_OPTIONS); a full run also
    needs the target's other arguments (seeds, repeats) for a verdict to mean the target's bound."""
    have, want = options(args), options(target.args)
    names = SHAPE_OPTIONS if smoke else tuple(want) + SHAPE_OPTIONS
    return all(have.get(k) == want.get(k) for k in names) and not (smoke and target.device == "cuda")


def _print_verdicts(verdicts: list[dict[str, Any]], smoke: bool) -> None:
    for v in verdicts:
        figure = "no figure"
        if "median" in v:
            figure = f"{v['median']:.4g} [{v['min']:.4g} - {v['max']:.4g}] over {v['n']}"
        target = next(t for t in TARGETS if t.name == v["target"])
        tag = " (smoke sizes: no verdict)" if smoke and v["status"] in ("met", "missed") else ""
        bound = target.bound_text
        print(f"[bench] {v['status']:>10}  {v['target']}: {figure} (bound {bound}){tag}", flush=True)


def _failures(verdicts: list[dict[str, Any]], smoke: bool) -> list[str]:
    bad = ("absent", "no record") if smoke else ("absent", "no record", "missed")
    return [f"{v['target']} ({v['status']})" for v in verdicts if v["status"] in bad]


def run_bench(args: argparse.Namespace) -> int:
    root = REPO_ROOT
    results = args.results_dir or root / "benchmarks" / "results"
    if args.gpu:
        from offpolicy.services.bench.gpu import main as gpu_main

        return gpu_main(["--results-dir", str(results), *shlex.split(args.args)])
    if args.report:
        records = read_records(results)
        if args.verify:
            same = render(records) == (root / "docs" / "benchmarks.md").read_text()
            what = "as the records render it" if same else "NOT as the records render it"
            print(f"[bench] docs/benchmarks.md is {what}")
            return 0 if same else 1
        changed = write_report(root, records)
        print(f"[bench] docs/benchmarks.md {'written' if changed else 'unchanged'} ({len(records)} records)")
        return 0
    if args.check and not args.names and not args.smoke:
        verdicts = check_records(read_records(results))
        _print_verdicts(verdicts, smoke=False)
        return _finish(verdicts, [], [], smoke=False, as_json=args.json)
    names = args.names or list(BENCHMARKS)
    extra = shlex.split(args.args)
    if extra and len(names) != 1:
        print("[bench] --args needs exactly one NAME", file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.smoke else 3)
    runs, failed, verdicts = [], [], []
    for name in names:
        print(f"[bench] {name} {' '.join(extra)} x {repeats}{' (smoke)' if args.smoke else ''}", flush=True)
        try:
            run = run_benchmark(
                root, name, extra, repeats=repeats, smoke=args.smoke,
                results_dir=None if args.no_record else results, timeout_s=args.timeout_s,
            )  # fmt: skip
        except (BenchmarkFailed, FileNotFoundError) as e:
            print(f"[bench] {name} failed: {e}", file=sys.stderr, flush=True)
            failed.append(name)
            continue
        runs.append(run)
        if run.written:
            print(f"[bench] {name}: record {run.record.path}", flush=True)
        if args.check:
            applying = [t for t in TARGETS if t.benchmark == name and _applies(t, extra, args.smoke)]
            mine = check_record(run.record, applying)
            _print_verdicts(mine, args.smoke)
            verdicts += mine
    return _finish(verdicts, runs, failed, smoke=args.smoke, as_json=args.json)


def _finish(verdicts, runs, failed: list[str], *, smoke: bool, as_json: bool) -> int:
    missed = _failures(verdicts, smoke)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
    if missed:
        what = "without a figure" if smoke else "not met"
        print(f"[bench] targets {what}: {', '.join(missed)}", file=sys.stderr)
    if as_json:
        print(json.dumps({
            "runs": [{"benchmark": r.record.benchmark, "record": r.record.id, "written": r.written,
                      "path": str(r.record.path) if r.written else None} for r in runs],
            "failed": failed, "verdicts": verdicts, "missed": missed,
        }))  # fmt: skip
    return 1 if failed or missed else 0
