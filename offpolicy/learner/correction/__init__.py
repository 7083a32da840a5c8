"""Rollout correction (verl 0.9.1 + DECISIONS): config, thresholds, presets, the math, metrics.

Modules, each importing only those above it (no cycle):
`thresholds` (IS / RS threshold specs parsed into numbers) -> `presets` (the preset catalogue and seed-era
aliases) -> `config` (`RolloutCorrectionConfig`) -> `metrics` (the `rollout_corr/*` metrics as device
tensors) -> `compute` (`compute_rollout_correction`: IS weights, RS / veto mask, metrics).
"""

from offpolicy.learner.correction.compute import SAFETY_BOUND, CorrectionResult, compute_rollout_correction
from offpolicy.learner.correction.config import RolloutCorrectionConfig

__all__ = ["SAFETY_BOUND", "CorrectionResult", "RolloutCorrectionConfig", "compute_rollout_correction"]
