"""RolloutCorrectionConfig: validation at construction (spec 1 table), threshold parsing, presets, aliases."""

from __future__ import annotations

import pydantic
import pytest

from offpolicy.learner.correction.config import (
    RolloutCorrectionConfig,
    RSOption,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)
from offpolicy.learner.correction.presets import ALIASES, CANONICAL_PRESETS, canonical_preset_name
from offpolicy.learner.errors import UnknownPreset

C = RolloutCorrectionConfig


def test_default_is_metrics_only_and_frozen():
    cfg = C()
    assert cfg.model_dump() == {
        "rollout_is": None,
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": False,
        "rollout_rs": None,
        "rollout_rs_threshold": None,
        "rollout_token_veto_threshold": None,
        "bypass_mode": False,
        "loss_type": "ppo_clip",
    }
    with pytest.raises(pydantic.ValidationError):
        cfg.rollout_is = "token"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        C(rollout_is_level="token")


def test_every_field_has_a_docstring():
    assert all(f.description for f in C.model_fields.values()), "use_attribute_docstrings must be on"


# --- threshold parsing


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (2.0, (2.0, None)),
        (3, (3.0, None)),
        ("2.5", (2.5, None)),
        (" 0.5_5.0 ", (5.0, 0.5)),
        ("1_1", (1.0, 1.0)),
    ],
)
def test_parse_is_threshold(spec, expected):
    assert parse_is_threshold(spec) == expected


def test_parse_rs_thresholds_examples_of_the_spec():
    opts = parse_rs_options(" token_k1 , seq_max_k2,token_k1")
    assert opts == ["token_k1", "seq_max_k2"]
    assert parse_rs_thresholds(opts, "0.6_1.6,2.5") == [
        RSOption("token_k1", 0.6, 1.6),
        RSOption("seq_max_k2", None, 2.5),
    ]
    assert parse_rs_thresholds(opts, "2.0") == [
        RSOption("token_k1", 0.5, 2.0),
        RSOption("seq_max_k2", None, 2.0),
    ]
    assert parse_rs_thresholds(["seq_mean_k1"], 1.001) == [RSOption("seq_mean_k1", 1 / 1.001, 1.001)]
    assert parse_rs_thresholds(["token_k1"], "0.5_2_0") is not None  # split on the first "_" only
    with pytest.raises(ValueError, match="must provide a single upper bound without '_'"):
        parse_rs_thresholds(opts, "0.5_2.0")


def test_raw_strings_and_floats_are_stored_unchanged():
    cfg = C(rollout_rs="seq_mean_k1,seq_max_k3", rollout_rs_threshold="0.8_1.2,3.0")
    assert (cfg.rollout_rs, cfg.rollout_rs_threshold) == ("seq_mean_k1,seq_max_k3", "0.8_1.2,3.0")
    assert C.decoupled_geo_rs_seq_tis(rs_threshold=1.001).rollout_rs_threshold == 1.001


# --- every error of the spec's table, at construction, naming field and value

ERRORS = [
    ({"rollout_is": "geometrik"}, "rollout_is", "Invalid rollout_is: geometrik"),
    ({"rollout_is_threshold": True}, "rollout_is_threshold", "not a boolean"),
    (
        {"rollout_is_threshold": [2.0]},
        "rollout_is_threshold",
        "must be a float or a string threshold specification",
    ),
    ({"rollout_is_threshold": "  "}, "rollout_is_threshold", "must not be an empty string"),
    ({"rollout_is_threshold": "abc"}, "rollout_is_threshold", "Invalid rollout_is_threshold 'abc'"),
    ({"rollout_is_threshold": "0.5_x"}, "rollout_is_threshold", "Invalid rollout_is_threshold '0.5_x'"),
    ({"rollout_is_threshold": -1}, "rollout_is_threshold", "upper bound must be positive, got -1.0"),
    ({"rollout_is_threshold": "0.5_0"}, "rollout_is_threshold", "upper bound must be positive, got 0.0"),
    ({"rollout_is_threshold": "-0.5_2"}, "rollout_is_threshold", "lower bound must be positive, got -0.5"),
    ({"rollout_is_threshold": "3_2"}, "rollout_is_threshold", "lower bound must be <= upper bound"),
    (
        {"rollout_rs": "token_k1"},
        "rollout_rs_threshold",
        "must be explicitly provided when rollout_rs is enabled",
    ),
    ({"rollout_rs": 3, "rollout_rs_threshold": 2.0}, "rollout_rs", "must be a non-empty string"),
    (
        {"rollout_rs": " , ,", "rollout_rs_threshold": 2.0},
        "rollout_rs",
        "must contain at least one valid option",
    ),
    (
        {"rollout_rs": "geometric", "rollout_rs_threshold": 2.0},
        "rollout_rs",
        "Invalid rollout_rs option: geometric",
    ),
    (
        {"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0},
        "rollout_rs",
        "Invalid rollout_rs option: seq_max_k1",
    ),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.0}, "rollout_rs", "Must be one of ['seq_max_k2'"),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": [2.0]},
        "rollout_rs_threshold",
        "must be a string or numeric",
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": True},
        "rollout_rs_threshold",
        "must be a string or numeric",
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": " , "},
        "rollout_rs_threshold",
        "at least one threshold value",
    ),
    (
        {"rollout_rs": "token_k1,token_k2,token_k3", "rollout_rs_threshold": "1,2"},
        "rollout_rs_threshold",
        "either one threshold shared by all options or exactly 3 thresholds",
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": "a_2"},
        "rollout_rs_threshold",
        "Invalid numeric threshold 'a_2' for option 'token_k1'",
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": "0_2"},
        "rollout_rs_threshold",
        "Thresholds for option 'token_k1' must be positive, got 0_2",
    ),
    (
        {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": -2.0},
        "rollout_rs_threshold",
        "Thresholds for option 'seq_sum_k1' must be positive, got -2.0",
    ),
    (
        {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "1.6_0.6"},
        "rollout_rs_threshold",
        "must be lower <= upper, got 1.6_0.6",
    ),
    (
        {"rollout_rs": "seq_max_k2", "rollout_rs_threshold": "0.5_2"},
        "rollout_rs_threshold",
        "single upper bound without '_'. Received '0.5_2'",
    ),
    (
        {"rollout_rs": "token_k3", "rollout_rs_threshold": "x"},
        "rollout_rs_threshold",
        "Invalid numeric threshold 'x' for option 'token_k3'",
    ),
    (
        {"rollout_rs": "seq_sum_k3", "rollout_rs_threshold": 0},
        "rollout_rs_threshold",
        "Threshold for option 'seq_sum_k3' must be positive, got 0",
    ),
    ({"rollout_token_veto_threshold": 0.0}, "rollout_token_veto_threshold", "must be a positive number"),
    ({"rollout_token_veto_threshold": True}, "rollout_token_veto_threshold", "must be a positive number"),
    ({"loss_type": "xyz"}, "loss_type", "Invalid loss_type: xyz. Must be 'reinforce' or 'ppo_clip'."),
]


@pytest.mark.parametrize(("kwargs", "field", "message"), ERRORS)
def test_invalid_settings_raise_at_construction_naming_field_and_value(kwargs, field, message):
    with pytest.raises(pydantic.ValidationError) as info:
        C(**kwargs)
    text = str(info.value)
    assert message in text
    assert f"{field}=" in text or field in text.splitlines()[1]
    value = kwargs.get(field)
    assert repr(value)[:20] in text or str(value)[:20] in text


def test_verl_accepted_nonsense_is_rejected_here():
    with pytest.raises(pydantic.ValidationError) as info:
        C(rollout_is="bogus", rollout_rs="nonsense", loss_type="xyz", rollout_is_threshold=-1)
    assert info.value.error_count() == 4


def test_is_level_with_threshold_none_is_accepted():
    assert not C(rollout_is="token", rollout_is_threshold=None).is_enabled


# --- presets (spec 2) and aliases (DESIGN.md)

PRESETS = {
    "decoupled_token_is": ("token", 2.0, None, None, False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", 2.0, None, None, False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, None, False, "ppo_clip"),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0", False, "ppo_clip"),
    "decoupled_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "bypass_ppo_clip": (None, 2.0, None, None, True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, True, "ppo_clip"),
    "bypass_pg_is": ("sequence", 2.0, None, None, True, "reinforce"),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, None, True, "reinforce"),
    "bypass_pg_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "disabled": (None, 2.0, None, None, False, "ppo_clip"),
}
FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
)


@pytest.mark.parametrize("name", list(PRESETS))
def test_canonical_preset_fields(name):
    cfg = getattr(C, name)()
    assert tuple(getattr(cfg, f) for f in FIELDS) == PRESETS[name]
    assert cfg.rollout_is_batch_normalize is False and cfg.rollout_token_veto_threshold is None
    assert C.from_preset(name) == cfg
    assert C.presets()[name] == cfg.model_dump()


def test_preset_catalogue_is_exactly_verls():
    assert set(CANONICAL_PRESETS) == set(PRESETS) == set(C.presets())


def test_preset_parameters_pass_through_and_are_validated():
    assert C.decoupled_token_icepop(threshold=4.0, threshold_lower=0.25).rollout_is_threshold == "0.25_4.0"
    assert (
        C.from_preset("decoupled_k3_rs_token_tis", is_threshold=3.0, rs_threshold=0.02).rollout_rs_threshold
        == 0.02
    )
    with pytest.raises(pydantic.ValidationError, match="must be lower <= upper"):
        C.decoupled_geo_rs(rs_threshold="1.1_0.9")
    with pytest.raises(TypeError):
        C.from_preset("bypass_ppo_clip", threshold=2.0)


ALIAS_EXPECTED = {
    "token_is": ("decoupled_token_is", {}),
    "token_tis": ("decoupled_token_is", {}),
    "seq_is": ("decoupled_seq_is", {}),
    "seq_is_rs": ("decoupled_seq_is_rs", {}),
    "seq_mis": ("decoupled_seq_is_rs", {}),
    "geo_rs": ("decoupled_geo_rs", {"rollout_token_veto_threshold": 1e-4}),
    "geo_mis": ("decoupled_geo_rs", {"rollout_token_veto_threshold": 1e-4}),
    "ppo_is_bypass": ("bypass_ppo_clip", {"rollout_is": "token", "rollout_is_threshold": 2.0}),
    "pure_is": ("bypass_pg_is", {}),
    "pg_is": ("bypass_pg_is", {}),
    "pg_rs": ("bypass_pg_geo_rs", {"rollout_token_veto_threshold": 1e-4}),
}


@pytest.mark.parametrize("alias", list(ALIAS_EXPECTED))
def test_seed_alias_builds_canonical_preset_plus_extras(alias):
    canonical, extra = ALIAS_EXPECTED[alias]
    assert canonical_preset_name(alias) == canonical
    expected = C(**{**getattr(C, canonical)().model_dump(), **extra})
    assert C.from_preset(alias) == expected


def test_alias_table_is_complete_and_takes_params():
    assert set(ALIASES) == set(ALIAS_EXPECTED)
    assert C.from_preset("token_tis", threshold=3.0).rollout_is_threshold == 3.0
    assert C.from_preset("ppo_is_bypass", threshold=1.5).rollout_is_threshold == 1.5
    assert C.from_preset("geo_rs", rs_threshold=1.001).rollout_rs_threshold == 1.001


def test_unknown_preset_raises():
    with pytest.raises(UnknownPreset, match="decoupled_k1_rs"):
        C.from_preset("decoupled_k1_rs")
