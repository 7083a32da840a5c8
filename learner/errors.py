"""Typed errors of the learner package; services/ maps them to HTTP statuses in one table."""

from __future__ import annotations


class LearnerError(Exception):
    """Base class of every error the learner raises on purpose."""


class CorrectionInputError(LearnerError, ValueError):
    """Tensors handed to the rollout correction or the losses are inconsistent (shapes, modes).

    Subclasses ValueError so that callers written against verl's helpers (which raise ValueError for the
    same conditions, with the same wording) keep working.
    """


class UnknownPreset(LearnerError, KeyError):
    """A rollout-correction preset name that is neither canonical nor a seed-era alias."""
