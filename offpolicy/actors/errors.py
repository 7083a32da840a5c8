"""Typed errors of the actor: each failure the rollout loop acts on (count, retry, stop) has its own class."""

from __future__ import annotations


class ActorError(Exception):
    """Base class of every error the actor raises."""


class DatasetError(ActorError):
    """The prompt dataset is missing, unreadable, empty, or a record lacks a usable `prompt`."""


class RewardError(ActorError):
    """A reward function raised or returned something that is not a finite number; the group is failed.

    `reason` is one of `offpolicy.actors.metrics.REWARD_FAILURE_REASONS` (a bounded metric label):
    `no_answer` and
    `bad_answer` are the data's fault (the record has no usable reference answer), the others the
    function's or the verifier's."""

    def __init__(self, message: str, reason: str = "raised") -> None:
        super().__init__(message)
        self.reason = reason


class WeightLoadError(ActorError):
    """Loading published weights into the engine failed (missing files, checksum mismatch, engine error)."""

    def __init__(self, version: int, reason: str, message: str) -> None:
        super().__init__(f"policy v{version}: {reason}: {message}")
        self.version = version
        self.reason = reason  # bounded label: "checksum", "missing", "timeout", "engine", "kind", ...


class PolicyKindMismatch(WeightLoadError):
    """A published record's kind does not match the engine: a `lora` adapter for an actor serving full
    weights, or `full` weights for one serving adapters (`engine.lora`). Refused, never loaded: the
    learner's `lora` section and the actors' `engine.lora` must agree."""

    def __init__(self, version: int, record_kind: str, engine_kind: str) -> None:
        want = "set engine.lora" if record_kind == "lora" else "remove engine.lora"
        super().__init__(
            version,
            "kind",
            f"the record holds {record_kind} weights, this actor's engine serves {engine_kind} weights: "
            f"not loaded ({want} on the actors, or change the learner's `lora` section)",
        )
        self.record_kind, self.engine_kind = record_kind, engine_kind


class EngineError(ActorError):
    """vLLM returned something the actor cannot turn into trajectories (e.g. missing log-probs)."""


class PromptFailed(EngineError):
    """vLLM refused or failed one prompt's request (validation, a request-level error); the engine is
    fine: the actor counts it (`engine_error`), skips the prompt and goes on."""


class EpisodeNotFound(ActorError):
    """No open episode has this id (never opened, finished, or expired)."""


class EpisodeConflict(ActorError):
    """A call does not fit the episode's state: its messages rewrite the recorded conversation, the episode
    is finished or out of budget, or its group already has all its episodes."""


class ChatRequestError(ActorError):
    """A chat request asks for something the gateway does not do (`field` names it), e.g. `n` > 1, a
    sampling parameter other than the actor's on a recorded call, streaming."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidSampling(ChatRequestError):
    """vLLM's own `SamplingParams` checks refused the parameters (`stop: [""]`, `max_tokens` < 1, ...);
    `field` names the parameter. Raised when the parameters are built, before a request records anything."""


class BudgetExceeded(EpisodeConflict):
    """A call does not fit the episode's budget: its new messages and at least one answer token need
    `needed` tokens, `left` are left. Nothing was recorded: a shorter call may follow."""

    def __init__(self, message: str, needed: int, left: int) -> None:
        super().__init__(message)
        self.needed, self.left = needed, left


class TooManyEpisodes(ActorError):
    """The gateway holds `gateway.max_open_episodes` open episodes; finish some or wait for expiry."""


class ActorNotRunning(ActorError):
    """The actor's loop is not running (starting, stopping or stopped): the gateway cannot serve or push."""


class RunNotFound(ActorError):
    """An actor pool serves no run of this id (never added, or removed)."""


class RunConflict(ActorError):
    """A run cannot join (or change on) this actor pool as asked: a duplicate run id, another base model,
    a full-weight run beside others (several runs need `engine.lora`), no room for its adapters. The
    message names the fix."""


class RunFieldFrozen(RunConflict):
    """A change to a running run touches fields that cannot change while it runs (`fields`): remove the run
    and add it again with them."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields
