"""offpolicy.config.loader: YAML, then OFFPOLICY_* variables of the mapping passed in, then overrides."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from offpolicy.config.loader import env_overrides, load_layered, merge


class Inner(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = 0.1
    steps: int = 1


class Outer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "x"
    inner: Inner = Inner()
    note: str | None = "n"


def test_env_overrides_nest_lowercase_parse_and_skip_other_prefixes():
    env = {"OFFPOLICY_INNER__STEPS": "3", "OFFPOLICY_NOTE": "", "OTHER_NAME": "y", "OFFPOLICY_NAME": "a b"}
    assert env_overrides(env) == {"inner": {"steps": 3}, "note": None, "name": "a b"}
    assert env_overrides({"APP_NAME": "z"}, prefix="APP_") == {"name": "z"}


def test_merge_is_deep_and_leaves_its_inputs_alone():
    base = {"a": {"b": 1, "c": 2}, "d": 3}
    assert merge(base, {"a": {"c": 5}, "e": 6}) == {"a": {"b": 1, "c": 5}, "d": 3, "e": 6}
    assert merge(base, {"a": 7}) == {"a": 7, "d": 3}
    assert base == {"a": {"b": 1, "c": 2}, "d": 3}


def test_layers_yaml_then_env_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: file\ninner:\n  lr: 0.5\n  steps: 2\n")
    env = {"OFFPOLICY_INNER__STEPS": "4", "OFFPOLICY_API_TOKEN": "secret", "OFFPOLICY_NAME": "env"}
    got = load_layered(Outer, path, env, {"name": "kw"})
    assert got == Outer(name="kw", inner=Inner(lr=0.5, steps=4), note="n")  # API_TOKEN: not a field, ignored


def test_reads_nothing_it_is_not_given(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_NAME", "from-process-env")
    assert load_layered(Outer) == Outer()


def test_rejects_a_non_mapping_file_and_invalid_values(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list\.yaml: the top level must be a mapping, got list"):
        load_layered(Outer, path)
    with pytest.raises(ValidationError):
        load_layered(Outer, None, {"OFFPOLICY_INNER__STEPS": "many"})
