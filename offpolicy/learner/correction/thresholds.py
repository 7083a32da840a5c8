"""Rollout-correction threshold specs parsed into numbers: IS bounds and rejection-sampling criteria.

verl 0.9.1's `_parse_rollout_is_threshold` / `_parse_rollout_rs_thresholds` with the same wording, every
error a ValueError (so pydantic turns it into a ValidationError naming the field). k1 bounds apply to
rho = pi_train / pi_rollout (DECISION 3). `RolloutCorrectionConfig` validates with these functions and
`learner/correction/compute.py` reads its numbers from them: the single source of both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROLLOUT_RS_OPTIONS: frozenset[str] = frozenset(
    {
        "token_k1",
        "token_k2",
        "token_k3",
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k2",
        "seq_max_k3",
    }
)
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: frozenset[str] = frozenset({"token_k1", "token_k2", "token_k3"})


@dataclass(frozen=True, slots=True)
class RSOption:
    """One parsed rejection-sampling criterion.

    For k1 options `lower`/`upper` are the documented bounds on the importance ratio rho (DECISION 3):
    a token / row is kept when `lower <= rho_stat <= upper`. For k2/k3 options `lower` is None and
    `upper` bounds the divergence statistic.
    """

    name: str
    lower: float | None
    upper: float


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's `_parse_rollout_is_threshold`: `(upper, lower)`; lower is None for TIS, set for IcePop.

    Raises ValueError with verl's wording (verl raises TypeError for the two type errors; pydantic only
    turns ValueError into a ValidationError, so both are ValueError here).
    """
    if isinstance(spec, bool):
        raise ValueError(
            "rollout_is_threshold must be specified as a float or a string threshold specification, "
            "not a boolean."
        )
    if isinstance(spec, int | float):
        upper, lower = float(spec), None
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError("rollout_is_threshold must not be an empty string.")
        try:
            if "_" in text:
                lower_str, upper_str = text.split("_", 1)
                lower, upper = float(lower_str), float(upper_str)
            else:
                upper, lower = float(text), None
        except ValueError as exc:
            raise ValueError(f"Invalid rollout_is_threshold '{spec}'.") from exc
    else:
        raise ValueError("rollout_is_threshold must be a float or a string threshold specification.")
    if not upper > 0:  # NaN fails too
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}.")
    if not math.isfinite(upper):
        raise ValueError(f"rollout_is_threshold upper bound must be finite, got {upper}.")
    if lower is not None:
        if not lower > 0:
            raise ValueError(f"rollout_is_threshold lower bound must be positive, got {lower}.")
        if lower > upper:
            raise ValueError("rollout_is_threshold lower bound must be <= upper bound.")
    return upper, lower


def parse_rs_options(rollout_rs: Any) -> list[str]:
    """Split the comma list, strip spaces, drop duplicates (keeping first positions), check names."""
    if not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    names = [part.strip() for part in rollout_rs.split(",") if part.strip()]
    if not names:
        raise ValueError("rollout_rs must contain at least one valid option.")
    for name in names:
        if name not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option: {name}. Must be one of {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}."
            )
    return list(dict.fromkeys(names))


def parse_rs_thresholds(options: list[str], spec: Any) -> list[RSOption]:
    """verl's `_parse_rollout_rs_thresholds`, one `RSOption` per option in order."""
    if spec is None:
        raise ValueError(
            "rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
            "Set rollout_rs_threshold to the desired threshold value."
        )
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(
            "rollout_rs_threshold must be a string or numeric value specifying per-option thresholds."
        )
    raw = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if not raw:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(raw) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold expects either one threshold shared by all options or exactly "
            f"{len(options)} thresholds to match the provided rollout_rs options."
        )
    if len(raw) == 1:
        raw = raw * len(options)
    return [_parse_one_rs_threshold(option, text) for option, text in zip(options, raw, strict=True)]


def _parse_one_rs_threshold(option: str, text: str) -> RSOption:
    if option.endswith("k1"):
        try:
            if "_" in text:
                lower_str, upper_str = text.split("_", 1)
                lower, upper = float(lower_str), float(upper_str)
            else:
                upper = float(text)
                lower = 1.0 / upper
        except (ValueError, ZeroDivisionError) as exc:
            if isinstance(exc, ZeroDivisionError):
                raise ValueError(f"Thresholds for option '{option}' must be positive, got {text}.") from exc
            raise ValueError(f"Invalid numeric threshold '{text}' for option '{option}'.") from exc
        if not (lower > 0 and upper > 0):
            raise ValueError(f"Thresholds for option '{option}' must be positive, got {text}.")
        if not (math.isfinite(lower) and math.isfinite(upper)):
            raise ValueError(f"Thresholds for option '{option}' must be finite, got {text}.")
        if lower > upper:
            raise ValueError(f"Thresholds for option '{option}' must be lower <= upper, got {text}.")
        return RSOption(option, lower, upper)
    if "_" in text:
        raise ValueError(
            f"rollout_rs_threshold for option '{option}' must provide a single upper bound "
            f"without '_'. Received '{text}'."
        )
    try:
        upper = float(text)
    except ValueError as exc:
        raise ValueError(f"Invalid numeric threshold '{text}' for option '{option}'.") from exc
    if not upper > 0:
        raise ValueError(f"Threshold for option '{option}' must be positive, got {text}.")
    if not math.isfinite(upper):
        raise ValueError(f"Threshold for option '{option}' must be finite, got {text}.")
    return RSOption(option, None, upper)
