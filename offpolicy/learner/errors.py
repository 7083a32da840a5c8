"""Typed errors of the learner package; services/ maps each to an HTTP status in one table."""

from __future__ import annotations


class LearnerError(Exception):
    """Base class of every error the learner raises on purpose."""


class CorrectionInputError(LearnerError, ValueError):
    """Tensors handed to the rollout correction or the losses are inconsistent (shapes, modes).

    Subclasses ValueError so that callers written against verl's helpers (which raise ValueError for the
    same conditions, with the same wording) keep working.
    """


class UnknownPreset(LearnerError, ValueError):
    """A rollout-correction preset name that is neither canonical nor a seed-era alias.

    A ValueError, so that a preset name given in place of `rollout_correction` fails validation like any
    other bad value: pydantic wraps it into a ValidationError with the field path.
    """


class BatchError(LearnerError, ValueError):
    """Groups that cannot be collated (empty, mismatched lengths, greedy sampling); the message says why."""


class FrozenFieldChange(LearnerError, ValueError):
    """A new config changes fields that cannot change while the learner runs; `fields` names them."""

    def __init__(self, fields: list[str]) -> None:
        super().__init__(f"cannot change while running: {', '.join(fields)}")
        self.fields = fields


class TokenizerMismatch(LearnerError, ValueError):
    """The distillation teacher's tokenizer is not the policy's (vocabulary or special tokens differ): its
    log-probs of the sampled token ids would score other tokens. Raised at start, naming both models."""


class CheckpointsDisabled(LearnerError):
    """An on-demand checkpoint was asked for, but the running config has `checkpoint.checkpoint_dir: null`."""


class WriteFailed(LearnerError):
    """A background write (published weights or a checkpoint) failed: a bug, raised in the training thread;
    or an `OSError` (a full disk), retried by the writer and raised only by a `flush` that waits for it.
    `tries`: consecutive failures of its kind."""

    def __init__(self, kind: str, version: int, cause: BaseException) -> None:
        super().__init__(f"background {kind} write of v{version} failed: {type(cause).__name__}: {cause}")
        self.kind, self.version, self.tries = kind, version, 1
        self.__cause__ = cause


class IntakeStopped(LearnerError):
    """The learner takes no new groups: checkpoints fail and `checkpoint.max_undurable_steps` learner steps
    are not covered by a durable one. The loop waits (state `waiting_for_checkpoint`) until one lands."""


class CheckpointMismatch(LearnerError):
    """The checkpoint folder holds a checkpoint of another run or another model; it is never resumed."""


class MemoryPlanError(LearnerError, ValueError):
    """The learner's memory plan per rank does not fit the device (learner/plan/memory.py); the message names
    the
    parts and the knobs that lower them."""
