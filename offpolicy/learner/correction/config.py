"""RolloutCorrectionConfig: the validated rollout-correction settings and their preset classmethods.

Fields and error wording follow verl 0.9.1 (`verl/trainer/config/algorithm.py`, `rollout_corr_helper.py`),
with the project's DECISIONS (../shared/spec/rollout_correction.md): every error is raised at
construction (a pydantic ValidationError naming field and value), the default is metrics only, k1 bounds
apply to rho = pi_train / pi_rollout as documented, `geometric` is an IS level, and the seed-era veto is
back as `rollout_token_veto_threshold`. The threshold parsers (`learner/correction/thresholds.py`, also
importable from here) are the single source of the numbers that `learner/correction/compute.py` uses.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from offpolicy.config.base import ConfigModel
from offpolicy.learner.correction.presets import CANONICAL_PRESETS, build_preset, matching_preset
from offpolicy.learner.correction.thresholds import (
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
    RSOption,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)

__all__ = [  # the parsers live in learner/correction/thresholds.py; these names stay importable from here
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "RSOption",
    "RolloutCorrectionConfig",
    "parse_is_threshold",
    "parse_rs_options",
    "parse_rs_thresholds",
]


def _named(field: str, value: Any, exc: ValueError) -> ValueError:
    return ValueError(f"{field}={value!r}: {exc}")


class RolloutCorrectionConfig(ConfigModel):
    """Rollout correction: importance sampling, rejection sampling, veto, decoupled or bypass PPO.

    `RolloutCorrectionConfig()` computes the off-policy metrics only (DECISION 2). Presets are
    classmethods (`decoupled_token_is()`, ...); `from_preset(name, **params)` also accepts the seed-era
    aliases. Every invalid setting raises a ValidationError when the model is built.
    """

    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    """IS aggregation level: per token, per sequence (product of ratios), or geometric (per-sequence
    geometric mean of the ratios). None = no IS weights (metrics only)."""

    rollout_is_threshold: float | str | None = 2.0
    """A positive number u (or numeric string): truncated IS, weights clamped at u. A string "l_u":
    IcePop, weights outside [l, u] set to 0. None with rollout_is set: IS silently skipped (as verl)."""

    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (over tokens for `token`, over sequences otherwise) after
    truncation, so that they average 1; an all-reduce when torch.distributed is initialized."""

    rollout_rs: str | None = None
    """Comma list of rejection criteria from {token,seq_sum,seq_mean}_k{1,2,3} and seq_max_k{2,3};
    a token survives only if every criterion keeps it. None = no rejection sampling."""

    rollout_rs_threshold: float | str | None = Field(None, validate_default=True)
    """One spec shared by all criteria, or one per criterion, comma separated. k1: "l_u" keeps
    l <= rho <= u for rho = pi_train/pi_rollout (a lone u means [1/u, u]); k2/k3: one positive upper
    bound. Required when rollout_rs is set."""

    rollout_token_veto_threshold: float | None = None
    """Veto (seed PR #3984): reject a whole sequence when any valid token has rho below this value
    (unclamped log-ratio < log(veto)), combined with RS by AND; typical 1e-4. None = off."""

    bypass_mode: bool = False
    """True: two policies, pi_old := pi_rollout, correction recomputed per micro-batch from pi_theta in
    the loss. False: decoupled mode, three policies, correction computed once per batch from pi_old."""

    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass-mode loss: PPO-clip with ratio pi_theta/pi_rollout (IS weights for metrics only), or
    REINFORCE -A*w*log pi_theta. Ignored in decoupled mode."""

    @field_validator("rollout_is", mode="before")
    @classmethod
    def _check_rollout_is(cls, value: Any) -> Any:
        if value is not None and value not in ("token", "sequence", "geometric"):
            raise ValueError(
                f"rollout_is={value!r}: Invalid rollout_is: {value}. "
                "Must be one of {'token', 'sequence', 'geometric'}."
            )
        return value

    @field_validator("rollout_is_threshold", mode="before")
    @classmethod
    def _check_is_threshold(cls, value: Any) -> Any:
        if value is not None:
            try:
                parse_is_threshold(value)
            except ValueError as exc:
                raise _named("rollout_is_threshold", value, exc) from exc
        return value

    @field_validator("rollout_rs", mode="before")
    @classmethod
    def _check_rollout_rs(cls, value: Any) -> Any:
        if value is not None:
            try:
                parse_rs_options(value)
            except ValueError as exc:
                raise _named("rollout_rs", value, exc) from exc
        return value

    @field_validator("rollout_rs_threshold", mode="before")
    @classmethod
    def _check_rs_threshold(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float | str)):
            raise ValueError(
                f"rollout_rs_threshold={value!r}: rollout_rs_threshold must be a string or numeric value "
                "specifying per-option thresholds."
            )
        rollout_rs = info.data.get("rollout_rs")  # absent when rollout_rs itself failed validation
        if rollout_rs is not None:
            try:
                parse_rs_thresholds(parse_rs_options(rollout_rs), value)
            except ValueError as exc:
                raise ValueError(f"rollout_rs={rollout_rs!r}, rollout_rs_threshold={value!r}: {exc}") from exc
        return value

    @field_validator("rollout_token_veto_threshold", mode="before")
    @classmethod
    def _check_veto(cls, value: Any) -> Any:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
        ):
            raise ValueError(
                f"rollout_token_veto_threshold={value!r}: rollout_token_veto_threshold must be a positive "
                "number (a ratio such as 1e-4) or None."
            )
        return value

    @field_validator("loss_type", mode="before")
    @classmethod
    def _check_loss_type(cls, value: Any) -> Any:
        if value not in ("ppo_clip", "reinforce"):
            raise ValueError(
                f"loss_type={value!r}: Invalid loss_type: {value}. Must be 'reinforce' or 'ppo_clip'."
            )
        return value

    # --- derived values used by learner/correction/compute.py

    @property
    def is_enabled(self) -> bool:
        """IS weights are computed (verl: rollout_is set and a threshold given)."""
        return self.rollout_is is not None and self.rollout_is_threshold is not None

    def is_bounds(self) -> tuple[float, float | None]:
        """`(upper, icepop_lower or None)` of the IS threshold; only meaningful when `is_enabled`."""
        return parse_is_threshold(self.rollout_is_threshold)

    def rs_options(self) -> list[RSOption]:
        """The parsed RS criteria in order (empty when rollout_rs is None)."""
        if self.rollout_rs is None:
            return []
        return parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)

    # --- presets (verl 0.9.1, spec section 2; aliases in learner/correction/presets.py)

    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled PPO with token-level truncated IS."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled PPO with sequence-level truncated IS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_token_icepop(
        cls, threshold: float = 5.0, threshold_lower: float = 0.5
    ) -> RolloutCorrectionConfig:
        """Decoupled PPO with token-level IcePop (weights outside [lower, upper] set to 0)."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def decoupled_seq_is_rs(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.5_2.0"
    ) -> RolloutCorrectionConfig:
        """Seq-MIS: sequence TIS plus seq_sum_k1 rejection."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_sum_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: str | float = "0.999_1.001") -> RolloutCorrectionConfig:
        """Geo-RS: seq_mean_k1 rejection, no IS."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Geo-RS plus sequence TIS."""
        return cls._with(
            rs="seq_mean_k1", is_level="sequence", is_threshold=is_threshold, rs_threshold=rs_threshold
        )

    @classmethod
    def decoupled_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Geo-RS plus token TIS."""
        return cls._with(
            rs="seq_mean_k1", is_level="token", is_threshold=is_threshold, rs_threshold=rs_threshold
        )

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: str | float = 0.01) -> RolloutCorrectionConfig:
        """seq_mean_k3 rejection (per-sequence KL estimate), no IS."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = 0.01
    ) -> RolloutCorrectionConfig:
        """seq_mean_k3 rejection plus sequence TIS."""
        return cls._with(
            rs="seq_mean_k3", is_level="sequence", is_threshold=is_threshold, rs_threshold=rs_threshold
        )

    @classmethod
    def decoupled_k3_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = 0.01
    ) -> RolloutCorrectionConfig:
        """seq_mean_k3 rejection plus token TIS."""
        return cls._with(
            rs="seq_mean_k3", is_level="token", is_threshold=is_threshold, rs_threshold=rs_threshold
        )

    @classmethod
    def bypass_ppo_clip(cls) -> RolloutCorrectionConfig:
        """Bypass mode, PPO-clip against pi_rollout, no IS or RS."""
        return cls(bypass_mode=True)

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: str | float = "0.999_1.001") -> RolloutCorrectionConfig:
        """Bypass PPO-clip with Geo-RS."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True)

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: str | float = 0.01) -> RolloutCorrectionConfig:
        """Bypass PPO-clip with seq_mean_k3 rejection."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True)

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Bypass REINFORCE with sequence TIS."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, loss_type="reinforce"
        )

    @classmethod
    def bypass_pg_token_icepop(
        cls, threshold: float = 5.0, threshold_lower: float = 0.5
    ) -> RolloutCorrectionConfig:
        """Bypass REINFORCE with token IcePop."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=f"{threshold_lower}_{threshold}",
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: str | float = "0.999_1.001") -> RolloutCorrectionConfig:
        """Bypass REINFORCE with Geo-RS."""
        return cls(
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Bypass REINFORCE with Geo-RS and sequence TIS."""
        return cls._with(
            rs="seq_mean_k1",
            is_level="sequence",
            is_threshold=is_threshold,
            rs_threshold=rs_threshold,
            pg=True,
        )

    @classmethod
    def bypass_pg_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: str | float = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Bypass REINFORCE with Geo-RS and token TIS."""
        return cls._with(
            rs="seq_mean_k1", is_level="token", is_threshold=is_threshold, rs_threshold=rs_threshold, pg=True
        )

    @classmethod
    def disabled(cls) -> RolloutCorrectionConfig:
        """Metrics only: no IS, no RS, decoupled mode."""
        return cls()

    @classmethod
    def _with(
        cls, *, rs: str, is_level: str, is_threshold: Any, rs_threshold: Any, pg: bool = False
    ) -> RolloutCorrectionConfig:
        return cls(
            rollout_is=is_level,
            rollout_is_threshold=is_threshold,
            rollout_rs=rs,
            rollout_rs_threshold=rs_threshold,
            bypass_mode=pg,
            loss_type="reinforce" if pg else "ppo_clip",
        )

    @classmethod
    def from_preset(cls, name: str, **params: Any) -> RolloutCorrectionConfig:
        """Build a preset by canonical name or seed-era alias (DESIGN.md), passing `params` through."""
        return build_preset(cls, name, params)

    def preset_name(self) -> str:
        """The preset this configuration is (canonical name, else seed alias), or "custom"."""
        return matching_preset(self)

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """Canonical preset names, each with the fields of its default configuration."""
        return {name: getattr(cls, name)().model_dump() for name in CANONICAL_PRESETS}
