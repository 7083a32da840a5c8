"""Benchmark records: what a run writes, how targets judge it, docs/benchmarks.md rendered from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offpolicy.services.bench.records import Record, read_records, summarize
from offpolicy.services.bench.report import figures, render, transcribe
from offpolicy.services.bench.runner import BenchmarkFailed, check_records, run_benchmark
from offpolicy.services.bench.targets import TARGETS, newest, options
from offpolicy.services.children import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"

FAKE = """
import json, os, sys
from pathlib import Path
count = Path(os.environ["FAKE_COUNTER"])
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
if "--fail" in sys.argv:
    print("boom", file=sys.stderr)
    sys.exit(3)
print("a table for people")
print(json.dumps({"ratio_dynamic_vs_plain": [0.9, 0.7, 0.8][n % 3], "nested": {"x": n, "ok": True},
                  "rows": [{"v": 10 * n}], "argv": sys.argv[1:]}))
"""


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "learning_signal.py").write_text(FAKE)
    monkeypatch.setenv("FAKE_COUNTER", str(tmp_path / "counter"))
    return tmp_path


def test_a_run_records_every_repeat_and_its_spread(fake_root: Path) -> None:
    results = fake_root / "results"
    run = run_benchmark(fake_root, "learning_signal", ["--seeds", "0", "1"], repeats=3, smoke=False,
                        results_dir=results)  # fmt: skip
    data = json.loads(run.record.path.read_text())
    assert run.written and run.record.path.parent == results / "learning_signal"
    assert [r["output"]["ratio_dynamic_vs_plain"] for r in data["repeats"]] == [0.9, 0.7, 0.8]
    assert data["summary"]["ratio_dynamic_vs_plain"] == {"min": 0.7, "median": 0.8, "max": 0.9, "n": 3}
    assert data["summary"]["rows.0.v"]["max"] == 20 and "nested.ok" not in data["summary"]  # bools: no figure
    assert data["args"] == ["--seeds", "0", "1"] and data["command"][1:3] == [
        "benchmarks/learning_signal.py",
        "--json",
    ]
    assert data["repeats"][0]["output"]["argv"] == ["--json", "--seeds", "0", "1"]
    assert data["git"] == {"sha": None, "dirty": None}  # not a git checkout: said so, not invented
    machine = data["machine"]
    assert machine["cpu_cores"] >= 1 and machine["torch"] and isinstance(machine["gpus"], list)
    assert len(data["loadavg_before"]) == 3 and all(len(r["loadavg_after"]) == 3 for r in data["repeats"])
    assert [r.id for r in read_records(results)] == [data["id"]]


def test_smoke_records_are_apart_and_a_failed_repeat_writes_nothing(fake_root: Path) -> None:
    results = fake_root / "results"
    run = run_benchmark(fake_root, "learning_signal", [], repeats=1, smoke=True, results_dir=results)
    assert run.record.id.endswith("-smoke") and run.record.smoke
    assert read_records(results) == [] and len(read_records(results, smoke=True)) == 1
    with pytest.raises(BenchmarkFailed, match="exit 3"):
        run_benchmark(fake_root, "learning_signal", ["--fail"], repeats=3, smoke=False, results_dir=results)
    assert read_records(results) == []
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "benchmarks/results/x/y-smoke.json"], cwd=REPO_ROOT
    )
    assert ignored.returncode == 0, "smoke records must not be committed"


def test_a_target_judges_the_median_of_the_record_run_with_its_arguments(fake_root: Path) -> None:
    results = fake_root / "results"
    target = next(t for t in TARGETS if t.name == "dynamic_sampling_steps")
    other = run_benchmark(fake_root, "learning_signal", ["--n", "8", *target.args], repeats=3, smoke=False,
                          results_dir=results)  # fmt: skip
    assert newest(read_records(results), target) is None, "another shape's record is not the target's"
    run_benchmark(
        fake_root, "learning_signal", list(target.args), repeats=3, smoke=False, results_dir=results
    )
    record = newest(read_records(results), target)
    assert record is not None and record.id != other.record.id
    verdict = target.verdict(record)
    assert (verdict["status"], verdict["median"], verdict["min"], verdict["max"]) == ("met", 0.8, 0.7, 0.9)
    record.data["repeats"][1]["output"]["ratio_dynamic_vs_plain"] = 0.95  # 0.9, 0.95, 0.8: median over
    assert target.verdict(record)["status"] == "missed"
    for repeat in record.data["repeats"]:
        del repeat["output"]["ratio_dynamic_vs_plain"]
    assert target.verdict(record)["status"] == "absent"


def test_options_compare_arguments_as_options() -> None:
    assert options(["--seeds", "0", "1", "--json", "--n=8"]) == {
        "--seeds": ("0", "1"),
        "--json": (),
        "--n": ("8",),
    }
    assert options(["--n", "8", "--seeds", "0"]) == options(["--seeds", "0", "--n", "8"])


def test_summarize_over_repeats() -> None:
    s = summarize([{"a": 1, "b": {"c": [2.0, 5]}}, {"a": 3, "b": {"c": [4.0]}}])
    assert s["a"] == {"min": 1, "median": 2.0, "max": 3, "n": 2}
    assert s["b.c.0"]["median"] == 3.0 and s["b.c.1"]["n"] == 1


def test_docs_benchmarks_md_is_what_the_committed_records_render() -> None:
    """`offpolicy bench --report` leaves docs/benchmarks.md as it is: its every figure is a record's."""
    records = read_records(RESULTS)
    assert any(r.source == "transcribed" for r in records) and any(r.source == "run" for r in records)
    assert render(records) == (REPO_ROOT / "docs" / "benchmarks.md").read_text(), (
        "docs/benchmarks.md differs from the records: run `offpolicy bench --report` (never edit it by hand)"
    )


@pytest.mark.parametrize("page", ["README.md", "docs/features.md"])
def test_every_figure_in_the_readme_is_in_a_committed_record(page: str) -> None:
    records = read_records(RESULTS)
    held = figures(render(records)) | figures(json.dumps([r.data for r in records], ensure_ascii=False))
    stated = figures((REPO_ROOT / page).read_text())
    assert stated <= held, f"{page} states figures no record holds: {sorted(stated - held)}"


def test_figures_finds_measurements_not_versions() -> None:
    assert figures("0.815× at 4 x 8; 42.4 % MFU; 3.3x; 1,016 steps; 2.7×") == {"0.815", "42.4", "3.3", "2.7"}
    assert figures("verl 0.9.1, v2.24, 127.0.0.1, B=256") == set()


def test_a_replacing_record_marks_the_row_and_keeps_it(tmp_path: Path) -> None:
    page = "# T\n\n## Sweep\n\ntext 0.5x\n\n| a | b |\n| --- | --- |\n| one | 0.79× |\n| two | 0.93× |\n"
    (old,) = transcribe(page, commit="abc", note="before records")
    new = {
        "record_version": 1, "id": "learning_signal/2026-12-02T000000Z-abc", "benchmark": "learning_signal",
        "source": "run", "created": "2026-12-02", "args": [], "git": {"sha": "abc", "dirty": False},
        "machine": {"cpu_cores": 2, "gpus": [], "torch": "2.13"}, "loadavg_before": [1.0],
        "loadavg_after": [1.0], "repeats": [{"output": {"ratio_dynamic_vs_plain": 0.81}}],
        "summary": summarize([{"ratio_dynamic_vs_plain": 0.81}]),
        "replaces": [{"record": old["id"], "table": 0, "row": 0, "why": "re-measured over 6 seeds"}],
    }  # fmt: skip
    records = [Record(tmp_path / "a.json", old), Record(tmp_path / "b.json", new)]
    text = render(records)
    assert "| one | 0.79× **Replaced by** [`learning_signal/2026-12-02T000000Z-abc`]" in text
    assert "| two | 0.93× |" in text and "text 0.5x" in text
    assert "0.81" in text  # the new record's row


def test_check_names_each_missed_target_and_exits_non_zero(fake_root: Path) -> None:
    results = fake_root / "results"
    target = next(t for t in TARGETS if t.name == "dynamic_sampling_steps")
    run = run_benchmark(
        fake_root, "learning_signal", list(target.args), repeats=1, smoke=False, results_dir=results
    )
    run.record.data["repeats"][0]["output"]["ratio_dynamic_vs_plain"] = 0.95
    run.record.path.write_text(json.dumps(run.record.data))
    verdicts = {v["target"]: v["status"] for v in check_records(read_records(results))}
    assert verdicts["dynamic_sampling_steps"] == "missed" and verdicts["correction_ms"] == "no record"
    done = subprocess.run(
        [sys.executable, "-m", "offpolicy.services.cli", "bench", "--check", "--results-dir", str(results)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "dynamic_sampling_steps (missed)" in done.stderr and "correction_ms (no record)" in done.stderr


def test_the_gpu_run_plans_every_stage_within_twelve_minutes(capsys: pytest.CaptureFixture[str]) -> None:
    from offpolicy.services.bench.gpu import STAGES, main

    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert sum(s.timeout_s for s in STAGES) <= 12 * 60
    for stage in ("tests", "4b", "1.3b", "4b-eager", "moe"):
        assert f"[gpu] {stage}: " in out
    mfu = {t.name: t for t in TARGETS}
    assert next(s for s in STAGES if s.name == "4b").args == mfu["mfu_4b"].args  # its record is the target's
    assert next(s for s in STAGES if s.name == "1.3b").args == mfu["mfu_1_78b"].args


def test_junit_counts_of_a_real_pytest_run(tmp_path: Path) -> None:
    from offpolicy.services.bench.gpu import junit_counts

    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip(reason='no gpu')\n"
        "def test_skip(): pass\n"
    )
    xml = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                    str(tmp_path / "test_x.py"), f"--junitxml={xml}", "-o", "addopts="], cwd=tmp_path,
                   capture_output=True, check=False,
                   env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # fmt: skip
    counts = junit_counts(xml)
    assert (counts["tests"], counts["passed"], counts["failed"], counts["skipped"]) == (3, 1, 1, 1)
    assert counts["failures"] == ["test_x::test_bad"]


def test_a_checkout_changed_during_the_run_is_recorded_dirty_under_the_commit_it_began_on(
    fake_root: Path,
) -> None:
    """The benchmark itself commits between repeats (as a developer committing while a long run goes on):
    the record names the commit the run began on, dirty, and where it ended."""
    git = ["git", "-C", str(fake_root), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    script = fake_root / "benchmarks" / "learning_signal.py"
    script.write_text(
        FAKE + "import subprocess\nsubprocess.run(['git', '-c', 'user.email=t@t', '-c', 'user.name=t', "
        "'commit', '-q', '--allow-empty', '-m', 'during'], check=True)\n"
    )
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    start = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert start != first
    run = run_benchmark(fake_root, "learning_signal", [], repeats=1, smoke=False, results_dir=None)
    got = run.record.data["git"]
    assert got["sha"] == start and got["dirty"] is True and got["sha_end"] not in (None, start)
    assert run.record.data["id"].endswith(f"{start[:9]}-dirty")
