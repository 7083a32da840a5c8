"""benchmarks/ imports as `python benchmarks/X.py` runs it: no script edits `sys.path` (`offpolicy` is
installed; a script's own folder is first on `sys.path`), and the scripts import each other by file name
(`from learner import synthetic_groups`), never as a `benchmarks.` package, which a script cannot see."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SIBLINGS = {p.stem for p in SCRIPTS}


def _touches_sys_path(tree: ast.AST) -> list[int]:
    """Lines that name `sys.path` (read, assigned, inserted into)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]


def _package_imports(tree: ast.AST) -> list[int]:
    """Lines that import benchmarks as a package (`from benchmarks.x import`, `import benchmarks`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(name.split(".")[0] == "benchmarks" for name in names):
            lines.append(node.lineno)
    return lines


def test_the_folder_holds_scripts():
    assert len(SCRIPTS) > 10 and {"learner", "staleness", "buffer"} <= SIBLINGS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_benchmark_edits_sys_path_or_imports_itself_as_a_package(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    assert not _touches_sys_path(tree), f"{path.name}: sys.path at lines {_touches_sys_path(tree)}"
    assert not _package_imports(tree), f"{path.name}: `benchmarks.` imports at lines {_package_imports(tree)}"


def test_the_check_sees_a_sys_path_edit_and_a_package_import():
    tree = ast.parse("import sys\nsys.path[0] = '..'\nfrom benchmarks.learner import x\n")
    assert _touches_sys_path(tree) == [2] and _package_imports(tree) == [3]
