"""configs/learner.yaml and configs/actor.yaml show the code's defaults: each key whose value there is not
the code's default says so on its line (`# not the default: X`), with the code's value, so a short YAML of a
user's (or a recipe's) takes what the files and the docs say it takes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.checks import ROOT
from offpolicy.actors.config import ActorConfig
from offpolicy.actors.config import load_config as load_actor_config
from offpolicy.config.loader import changed_fields
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config import load_config as load_learner_config

MARK = re.compile(r"not the default(?:: (.+?))?(?:;|$)")


def comments(path: Path) -> dict[str, str]:
    """Each key's dotted path in the file (by indentation) -> the comment on its line."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in path.read_text().splitlines():
        m = re.match(r"^( *)([A-Za-z_]\w*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        out[".".join(k for _, k in stack)] = rest.split("#", 1)[1] if "#" in rest else ""
    return out


def at(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def differing(path: Path) -> tuple[list[str], dict[str, Any]]:
    """The dotted fields where the file's config is not the code's default, and the defaults."""
    if path.name == "learner.yaml":
        config = load_learner_config(path, {})
        default = LearnerConfig(model_path=config.model_path)
    else:
        config = load_actor_config(path, {})
        default = ActorConfig.model_validate(
            {"model_path": config.model_path, "dataset": {"path": config.dataset.path}}
        )
    ours, theirs = default.model_dump(mode="json"), config.model_dump(mode="json")
    return changed_fields(ours, theirs), ours


@pytest.mark.parametrize("name", ["learner.yaml", "actor.yaml"])
def test_every_key_that_is_not_the_codes_default_says_so_with_the_default(name):
    path = ROOT / "configs" / name
    fields, defaults = differing(path)
    assert fields, "the file changes nothing: then it needs no marks"
    lines = comments(path)
    for field in fields:
        # the line that sets it: the field itself, or a section given by name (rollout_correction: preset)
        line = next(p for p in (field, field.rsplit(".", 1)[0], field.split(".", 1)[0]) if p in lines)
        mark = MARK.search(lines[line])
        assert mark, (
            f"{name}: {line} is not the code's default ({field}); its line must say `not the default`"
        )
        default = at(defaults, field) if line == field else None
        if line == field:
            assert yaml.safe_load(mark.group(1)) == default, (field, mark.group(1), default)
    marked = {p for p, c in lines.items() if MARK.search(c)}
    lines_of = {next(p for p in (f, f.rsplit(".", 1)[0], f.split(".", 1)[0]) if p in lines) for f in fields}
    assert marked == lines_of, f"marked but the code's default after all: {marked - lines_of}"
