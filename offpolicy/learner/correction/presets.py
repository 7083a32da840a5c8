"""The rollout-correction preset catalogue: canonical verl 0.9.1 names and seed-era aliases (DESIGN.md).

The builders take the config class as `cls` (`RolloutCorrectionConfig`, which imports this module) and are
generic in it (`Config`), so this module never imports it back, not even for type checking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from offpolicy.learner.errors import UnknownPreset

Config = TypeVar("Config", bound=BaseModel)
"""The config class the builders receive as `cls`: `RolloutCorrectionConfig` (correction/config.py)."""

# verl 0.9.1 has these 19 preset classmethods (the spec's "20" miscounts its own table).
CANONICAL_PRESETS: tuple[str, ...] = (
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_token_icepop",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "decoupled_geo_rs_seq_tis",
    "decoupled_geo_rs_token_tis",
    "decoupled_k3_rs",
    "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis",
    "bypass_ppo_clip",
    "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs",
    "bypass_pg_is",
    "bypass_pg_token_icepop",
    "bypass_pg_geo_rs",
    "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis",
    "disabled",
)

SEED_VETO = 1e-4
"""The veto threshold of the seed presets `geo_rs`, `geo_mis` and `pg_rs` (PR #3984 / #4070)."""


def _ppo_is_bypass(cls: type[Config], threshold: float = 2.0) -> Config:
    # Seed `ppo_is_bypass`: bypass PPO-clip, with token IS (2.0) computed for the metrics.
    return cls(
        **{**cls.bypass_ppo_clip().model_dump(), "rollout_is": "token", "rollout_is_threshold": threshold}
    )


def _with_veto(canonical: str) -> Callable[..., BaseModel]:
    def build(cls: type[Config], **params: Any) -> Config:
        base = getattr(cls, canonical)(**params)
        return cls(**{**base.model_dump(), "rollout_token_veto_threshold": SEED_VETO})

    return build


def _plain(canonical: str) -> Callable[..., BaseModel]:
    def build(cls: type[Config], **params: Any) -> Config:
        return getattr(cls, canonical)(**params)

    return build


# alias -> (canonical name, builder)
ALIASES: dict[str, tuple[str, Callable[..., BaseModel]]] = {
    "token_is": ("decoupled_token_is", _plain("decoupled_token_is")),
    "token_tis": ("decoupled_token_is", _plain("decoupled_token_is")),
    "seq_is": ("decoupled_seq_is", _plain("decoupled_seq_is")),
    "seq_is_rs": ("decoupled_seq_is_rs", _plain("decoupled_seq_is_rs")),
    "seq_mis": ("decoupled_seq_is_rs", _plain("decoupled_seq_is_rs")),
    "geo_rs": ("decoupled_geo_rs", _with_veto("decoupled_geo_rs")),
    "geo_mis": ("decoupled_geo_rs", _with_veto("decoupled_geo_rs")),
    "ppo_is_bypass": ("bypass_ppo_clip", _ppo_is_bypass),
    "pure_is": ("bypass_pg_is", _plain("bypass_pg_is")),
    "pg_is": ("bypass_pg_is", _plain("bypass_pg_is")),
    "pg_rs": ("bypass_pg_geo_rs", _with_veto("bypass_pg_geo_rs")),
}


def canonical_preset_name(name: str) -> str:
    """The canonical preset name for a canonical name or a seed-era alias; UnknownPreset otherwise."""
    if name in CANONICAL_PRESETS:
        return name
    if name in ALIASES:
        return ALIASES[name][0]
    raise UnknownPreset(
        f"Unknown rollout-correction preset {name!r}. "
        f"Known: {list(CANONICAL_PRESETS)} and aliases {sorted(ALIASES)}."
    )


def build_preset(cls: type[Config], name: str, params: dict[str, Any]) -> Config:
    """Build preset `name` (canonical or alias) with keyword `params`; TypeError for unknown params."""
    canonical_preset_name(name)
    if name in CANONICAL_PRESETS:
        return getattr(cls, name)(**params)
    return ALIASES[name][1](cls, **params)


def matching_preset(config: BaseModel) -> str:
    """The name of the preset whose default configuration `config` equals: a canonical name first, else a
    seed-era alias (the veto variants differ from their canonical preset), else "custom"."""
    cls = type(config)
    for name in (*CANONICAL_PRESETS, *ALIASES):
        if build_preset(cls, name, {}) == config:
            return name
    return "custom"
