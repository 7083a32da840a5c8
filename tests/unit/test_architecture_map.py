"""docs/architecture.md's module map names exactly the modules under offpolicy/: every `.py` and `.lua` file
once (a package's `__init__.py` as its folder or as the file), nothing that is not there, one line each with
its job, under the heading of its folder. A module added, moved or removed without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## The module map"
ENTRY = re.compile(r"^- `(offpolicy/[^`]*)`: (\S.*)$")
FOLDER = re.compile(r"^### (offpolicy/(?:[\w]+/)*)$")


def map_lines() -> list[str]:
    """The lines of the module map section (from its heading to the next `## ` heading)."""
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else len(text)].splitlines()[1:]


def listed(lines: list[str]) -> dict[str, str]:
    """Each listed path -> the folder heading it stands under (`offpolicy/.../`)."""
    entries: dict[str, str] = {}
    folder = None
    for line in lines:
        if heading := FOLDER.match(line):
            folder = heading.group(1)
        elif line.startswith("- "):
            entry = ENTRY.match(line)
            assert entry, f"not a `- `path`: job` line: {line!r}"
            path = entry.group(1)
            assert path not in entries, f"listed twice: {path}"
            entries[path] = folder
        elif folder is not None:  # after the first folder heading: headings, entries, blank lines only
            assert not line.strip(), f"stray line in the map: {line!r}"
    return entries


def as_listed(module: str) -> str:
    """How the map names a module: a package's `__init__.py` by its folder (the file's name is fine too)."""
    return module.removesuffix("__init__.py")


def modules() -> set[str]:
    """Every .py and .lua file under offpolicy/ (caches left out), as the map names it."""
    return {
        as_listed(p.relative_to(ROOT).as_posix())
        for p in (ROOT / "offpolicy").rglob("*")
        if p.suffix in (".py", ".lua") and "__pycache__" not in p.parts
    }


def drift(lines: list[str]) -> tuple[list[str], list[str]]:
    """(modules the map misses, listed paths that are not modules)."""
    names = {as_listed(path) for path in listed(lines)}
    return sorted(modules() - names), sorted(names - modules())


def test_the_map_lists_exactly_the_modules_under_offpolicy():
    missing, extra = drift(map_lines())
    assert not missing and not extra, (
        f"docs/architecture.md's module map is out of date: missing {missing}, not in the tree {extra}"
    )


def test_each_module_stands_under_its_own_folder():
    for path, folder in listed(map_lines()).items():
        own = path if path.endswith("/") else path.rsplit("/", 1)[0] + "/"
        assert folder == own, f"{path} is listed under {folder}, not {own}"


def test_the_check_sees_a_missing_and_a_stale_line():
    lines = [x for x in map_lines() if not x.startswith("- `offpolicy/buffer/codec.py`")]
    lines.append("- `offpolicy/buffer/gone.py`: a module that is not there")
    assert drift(lines) == (["offpolicy/buffer/codec.py"], ["offpolicy/buffer/gone.py"])
