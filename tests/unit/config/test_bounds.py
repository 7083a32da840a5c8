"""Every number a config holds is bounded above where it spends something shared: a walk over every config
model (the actor's and its pool's runs, the learner's, the REST bodies built from them) finds each int and
float field and fails on one without an upper bound unless it is named below as spending nothing (a
coefficient of the loss, a threshold on a ratio, a label). A new field must either take its bound or be
listed here with why it needs none; the bound's error names the field and the limit."""

from __future__ import annotations

import copy
import typing
from collections.abc import Iterator

import annotated_types
import pydantic
import pytest
from pydantic import BaseModel

from offpolicy.actors.config import ActorConfig
from offpolicy.learner.config import LearnerConfig

ROOTS: tuple[type[BaseModel], ...] = (ActorConfig, LearnerConfig)

SPENDS_NOTHING: dict[str, str] = {
    # the loss and the optimizer: coefficients and ratios (their ranges are the algorithm's)
    "OptimizerConfig.lr": "coefficient",
    "OptimizerConfig.betas": "coefficient",
    "OptimizerConfig.eps": "coefficient",
    "OptimizerConfig.weight_decay": "coefficient",
    "CriticConfig.lr": "coefficient",
    "CriticConfig.cliprange_value": "coefficient",
    "CriticConfig.loss_coef": "coefficient",
    "LearnerConfig.clip_ratio_high": "coefficient",
    "LearnerConfig.clip_ratio_c": "coefficient",
    "LearnerConfig.grad_clip": "coefficient",
    "LearnerConfig.kl_loss_coef": "coefficient",
    "LearnerConfig.entropy_coeff": "coefficient",
    "LoraConfig.alpha": "coefficient",
    "MoeConfig.aux_loss_coef": "coefficient",
    "MoeConfig.z_loss_coef": "coefficient",
    "TeacherConfig.reward_weight": "coefficient",
    "TeacherConfig.task_reward_weight": "coefficient",
    "ScreeningConfig.zero_variance_eps": "threshold on a reward spread",
    "ScreeningConfig.overlong_penalty": "coefficient",
    "RolloutCorrectionConfig.rollout_is_threshold": "threshold on an importance ratio",
    "RolloutCorrectionConfig.rollout_rs_threshold": "threshold on an importance ratio",
    "RolloutCorrectionConfig.rollout_token_veto_threshold": "threshold on an importance ratio",
    "BufferConfig.priority_epsilon": "coefficient",
    # sampling and rewards: they shape what is generated, not how much
    "SamplingConfig.temperature": "sampling shape",
    "SamplingConfig.top_k": "sampling shape",
    "RewardConfig.length_penalty": "coefficient",
    "EvalConfig.pass_threshold": "threshold on a reward",
    # labels
    "ReloadConfig.initial_version": "a policy version: a label",
}


def _numeric(annotation: object) -> bool:
    if annotation in (int, float):
        return True
    return any(
        _numeric(a) for a in typing.get_args(annotation) if not isinstance(a, pydantic.fields.FieldInfo)
    )


def _bounded_above(metadata: list[object]) -> bool:
    return any(isinstance(m, annotated_types.Le | annotated_types.Lt) for m in metadata)


def _annotated_metadata(annotation: object) -> Iterator[object]:
    """The constraints inside `Annotated[...]` types of a field's annotation (a union's members too)."""
    if typing.get_origin(annotation) is typing.Annotated:
        for m in typing.get_args(annotation)[1:]:
            yield from (m.metadata if isinstance(m, pydantic.fields.FieldInfo) else [m])
    for arg in typing.get_args(annotation):
        if typing.get_origin(annotation) is not typing.Annotated:
            yield from _annotated_metadata(arg)


def _models(annotation: object) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def walk(roots: tuple[type[BaseModel], ...] = ROOTS) -> dict[str, pydantic.fields.FieldInfo]:
    """`Model.field` -> field, for every numeric field of every model reachable from `roots`."""
    seen: set[type[BaseModel]] = set()
    todo, fields = list(roots), {}
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            todo.extend(_models(field.annotation))
            if _numeric(field.annotation) and field.annotation is not bool:
                fields[f"{model.__name__}.{name}"] = field
    return fields


def test_every_number_that_spends_something_has_an_upper_bound():
    fields = walk()
    assert len(fields) > 100, "the walk reaches every config model"
    unbounded = sorted(
        name
        for name, f in fields.items()
        if name not in SPENDS_NOTHING
        and not _bounded_above([*f.metadata, *_annotated_metadata(f.annotation)])
    )
    assert unbounded == [], f"numeric config fields without an upper bound: {unbounded}"
    assert set(SPENDS_NOTHING) <= set(fields), sorted(set(SPENDS_NOTHING) - set(fields))


ACTOR = {"model_path": "/m", "dataset": {"path": "/d.jsonl"}}


@pytest.mark.parametrize(
    ("model", "base", "path", "value", "limit"),
    [
        (LearnerConfig, {"model_path": "/m"}, ("groups_per_step",), 10**9, "65536"),
        (LearnerConfig, {"model_path": "/m"}, ("publish", "keep_versions"), 2**64, "10000"),
        (LearnerConfig, {"model_path": "/m"}, ("sample_timeout_s",), 1e300, "86400"),
        (ActorConfig, ACTOR, ("buffer", "max_size"), 2**64, "1000000000"),
        (ActorConfig, ACTOR, ("reload", "prefetch_max_bytes"), 2**64, str(2**50)),
        (
            ActorConfig,
            ACTOR | {"eval": {"dataset": {"path": "/e.jsonl"}}},
            ("eval", "max_prompts"),
            10**10,
            "1000000000",
        ),
    ],
)
def test_an_out_of_bounds_value_is_refused_naming_the_field_and_the_limit(model, base, path, value, limit):
    body = copy.deepcopy(base)
    node = body
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(pydantic.ValidationError) as e:
        model.model_validate(body)
    (error,) = e.value.errors()
    assert error["loc"] == path and f"less than or equal to {limit}" in error["msg"], error
