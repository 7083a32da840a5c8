"""`offpolicy.config.base.ConfigModel`: every number field of every config refuses NaN, ±inf, overflow and
booleans;
strings, ids and paths are bounded; secrets are redacted (`offpolicy.config.secrets`)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from offpolicy.actors.config import ActorConfig
from offpolicy.buffer.config import BufferConfig
from offpolicy.config.base import MAX_STR, ConfigModel, _mentions_bool
from offpolicy.config.secrets import Redactor, redact_url, url_secrets
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.correction.config import RolloutCorrectionConfig

MODELS: dict[type[BaseModel], dict[str, Any]] = {
    LearnerConfig: {"model_path": "/models/tiny"},
    ActorConfig: {"model_path": "/models/tiny", "dataset": {"path": "/data/p.jsonl"}},
    BufferConfig: {},
    RolloutCorrectionConfig: {},
}


def _number_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of every field (nested models included) whose annotation mentions int or float."""
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _number_fields(ann, (*prefix, name))
        elif any(t in repr(ann) for t in ("float", "int")) and not _mentions_bool(ann):
            out.append((*prefix, name))
    return out


def _with(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = dict(base)
    node = out
    for part in path[:-1]:
        node[part] = dict(node.get(part, {}))
        node = node[part]
    node[path[-1]] = value
    if path[-1] == "rollout_rs_threshold":
        node["rollout_rs"] = "token_k1"  # read only when rejection sampling is on
    return out


CASES = [(model, path) for model in MODELS for path in _number_fields(model)]


def test_the_walk_finds_the_number_fields() -> None:
    paths = {(m.__name__, ".".join(p)) for m, p in CASES}
    assert ("LearnerConfig", "optimizer.lr") in paths
    assert ("LearnerConfig", "rollout_correction.rollout_is_threshold") in paths
    assert ("ActorConfig", "engine.gpu_memory_utilization") in paths
    assert ("BufferConfig", "samples_per_insert") in paths
    assert len(CASES) > 60


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1e309", "Infinity", True, False])
@pytest.mark.parametrize(("model", "path"), CASES, ids=[f"{m.__name__}.{'.'.join(p)}" for m, p in CASES])
def test_every_number_field_is_finite_and_not_a_bool(model: type[BaseModel], path: tuple, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(_with(MODELS[model], path, value))
    assert any(tuple(str(x) for x in e["loc"][: len(path)]) == path for e in info.value.errors()), info.value


def test_ints_refuse_fractions_and_bools_but_take_whole_floats() -> None:
    with pytest.raises(ValidationError, match="fractional part"):
        LearnerConfig(model_path="/m", ppo_epochs=1.5)
    with pytest.raises(ValidationError, match="boolean is not a valid value"):
        LearnerConfig(model_path="/m", groups_per_step=True)
    assert LearnerConfig(model_path="/m", ppo_epochs=2.0).ppo_epochs == 2
    assert LearnerConfig(model_path="/m", norm_adv_by_std_in_grpo=False).norm_adv_by_std_in_grpo is False


def test_threshold_strings_are_finite_too() -> None:
    for bad in ({"rollout_is": "token", "rollout_is_threshold": "inf"},
                {"rollout_is": "token", "rollout_is_threshold": "0.5_1e309"},
                {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_inf"},
                {"rollout_rs": "seq_max_k2", "rollout_rs_threshold": "nan"}):  # fmt: skip
        with pytest.raises(ValidationError):
            RolloutCorrectionConfig(**bad)
    ok = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_5.0")
    assert ok.rollout_is_threshold == "0.5_5.0"


def test_strings_ids_and_paths_are_bounded() -> None:
    with pytest.raises(ValidationError, match="at most 4096"):
        LearnerConfig(model_path="/m", metrics_jsonl="/tmp/" + "a/" * MAX_STR)
    with pytest.raises(ValidationError, match="255"):
        LearnerConfig(model_path="/m", metrics_jsonl="/tmp/" + "a" * 256 + ".jsonl")
    with pytest.raises(ValidationError, match="NUL"):
        LearnerConfig(model_path="/m\x00x")
    with pytest.raises(ValidationError, match="at most 128"):
        LearnerConfig(model_path="/m", run_id="r" * 129)
    with pytest.raises(ValidationError, match="at most 4096"):
        LearnerConfig(model_path="/m", redis_url="redis://h/" + "0" * MAX_STR)
    assert LearnerConfig(model_path="/m", metrics_jsonl="/tmp/" + "a" * 255).metrics_jsonl


def test_every_config_model_derives_from_the_strict_base() -> None:
    def walk(model: type[BaseModel]) -> list[type[BaseModel]]:
        nested = [f.annotation for f in model.model_fields.values()]
        subs = [m for m in nested if isinstance(m, type) and issubclass(m, BaseModel)]
        return [model, *(x for m in subs for x in walk(m))]

    for root in MODELS:
        for model in walk(root):
            assert issubclass(model, ConfigModel), model


def test_redact_url_and_the_redactor() -> None:
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://user:p%40ss@h/0") == "redis://user:***@h/0"
    assert redact_url("redis://h/0?password=xx&db=1") == "redis://h/0?password=***&db=1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert url_secrets("redis://user:p%40ss@h/0") == ["p%40ss", "p@ss"]
    redactor = Redactor([*url_secrets("redis://:pw-long@h/0"), "t0k3n", None])
    assert redactor.scrub("AUTH pw-long failed; token t0k3n") == "AUTH *** failed; token ***"
    assert redactor.scrub_json({"a": ["pw-long", 1, {"t0k3n": "x"}]}) == {"a": ["***", 1, {"***": "x"}]}
