"""The rollout-correction preset catalogue (learner/correction/presets.py) as the API's `Preset` models."""

from __future__ import annotations

from offpolicy.learner.correction.config import RolloutCorrectionConfig
from offpolicy.learner.correction.presets import ALIASES, canonical_preset_name
from offpolicy.services.learner_api.schemas import Preset


def list_presets() -> list[Preset]:
    """Every canonical preset with its aliases and the fields of its default configuration."""
    return [
        Preset(name=name, aliases=_aliases_of(name), fields=RolloutCorrectionConfig.from_preset(name))
        for name in RolloutCorrectionConfig.presets()
    ]


def get_preset(name: str) -> Preset:
    """One preset by canonical name or alias (an alias shows its own fields, e.g. the seed veto);
    `UnknownPreset` (404 in the error table) for any other name."""
    canonical = canonical_preset_name(name)
    return Preset(
        name=canonical, aliases=_aliases_of(canonical), fields=RolloutCorrectionConfig.from_preset(name)
    )


def _aliases_of(canonical: str) -> list[str]:
    return sorted(alias for alias, (target, _) in ALIASES.items() if target == canonical)
