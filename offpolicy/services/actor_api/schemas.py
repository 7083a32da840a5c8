"""Request and response models of the actor service: its status, its runs (`/v1/runs`), the gateway's
episodes."""

from __future__ import annotations

from typing import Annotated

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field

from offpolicy.config.base import IdStr, RunId

FiniteFloat = Annotated[float, AllowInfNan(False)]


class ActorStatus(BaseModel):
    """What the actor is doing: its loaded weights, throughput and output."""

    state: str
    """`starting` (engine loading), `running`, `stopped` or `failed`; `idle`: a pool serving no run (all
    removed); `removed`: a run's last status (`DELETE /v1/runs/{run_id}`)."""
    actor_id: str
    """This actor's id, as stamped on its groups."""
    loaded_policy_version: int | None
    """Policy version of the weights in the engine (`engine.lora`: of the newest adapter, or the base's
    before any); null before the first load."""
    policy_kind: str = "full"
    """What the engine loads: `full` weights, or `lora` adapters on the base model (`engine.lora`)."""
    adapter_version: int | None = None
    """`engine.lora`: the newest adapter's version (what new requests carry); null before any."""
    adapters_loaded: list[int] | None = None
    """`engine.lora`: the versions of the adapters the engine holds (the newest and those of requests still
    in flight); null for full weights."""
    refused_record: str | None = None
    """Why the newest refused policy record was not loaded: its kind is not the engine's (`lora` for a
    full-weight actor, or `full` for one with `engine.lora`); null when none was refused."""
    learner_policy_version: int | None
    """Newest version the learner published (from the policy record); null when none yet."""
    tokens_per_s: float | None
    """Generated tokens per second over the last batch; null before the first batch."""
    groups_pushed: int
    """Groups inserted into the buffer since start."""
    reloads: int
    """Weight reloads done since start."""
    reward_failures: dict[str, int] = Field(default_factory=dict)
    """Groups set aside because their reward failed, by reason (those that happened; the reasons are
    `offpolicy.actors.metrics.REWARD_FAILURE_REASONS`: `no_answer`, `bad_answer`, `raised`, `timeout`,
    ...)."""
    reward_failure_alarm: str | None = None
    """Set while more than half of the groups failed their reward (judged after the first 20): the count
    and the commonest reason; the same line is logged once as an ERROR."""
    error: str | None = None
    """Why the loop stopped, when it failed."""
    mode: str = "train"
    """`train` (generates into the buffer) or `eval` (an evaluation actor: pushes nothing)."""
    last_eval: dict[str, float | None] | None = None
    """The last evaluation's `eval/...` metrics (reward mean, pass@k, version); null before the first."""
    runs: dict[str, str] = Field(default_factory=dict)
    """Every run the actor serves (an actor pool: `GET /v1/runs`) and its state: `running`, `stopped` or
    `failed`; the status above is the first run's."""
    failed_runs: dict[str, str] = Field(default_factory=dict)
    """The runs whose loop died and why (their `error`): each holds its share of the pool until `DELETE
    /v1/runs/{run_id}` frees it (`offpolicy_actor_run_failed`). Empty when none."""


# --- the runs of an actor pool (actors/rollout/pool.py)


class RunStatus(ActorStatus):
    """One run of the actor's pool: its status, id and share of the engine."""

    run_id: str
    """The run's id (its keys in Redis, its learner's)."""
    max_inflight_prompts: int
    """Its share of the engine: the prompts it keeps in it."""


class RunList(BaseModel):
    """`GET /v1/runs`: every run the actor serves, in the order they were added."""

    runs: list[RunStatus]


# --- the gateway (actors/gateway/agent_episodes.py)


class OpenEpisode(BaseModel):
    """`POST /v1/episodes`: open an episode of a group."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: IdStr
    """The task's id; episodes of one prompt form a group unless `group_id` says otherwise."""
    group_id: IdStr | None = None
    """The group this episode joins (opened by its first episode); null = the prompt's open group."""
    group_size: int | None = Field(None, ge=1, le=1024)
    """Episodes in the group; null = `gateway.group_size`, else `sampling.n`."""
    answer: str | None = Field(None, max_length=65_536)
    """The reference answer the configured reward function reads (when a finish has no reward)."""
    metadata: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=65_536)]] = Field(
        default_factory=dict, max_length=64
    )
    """Stored with the group (strings)."""
    run_id: RunId | None = None
    """The run of the actor's pool whose gateway records the episode (its chat calls and finish find it by
    its id); null = the first run."""


class EpisodeOpened(BaseModel):
    """An open episode: send its id as `X-Episode-Id` with each chat call."""

    episode_id: str
    group_id: str
    group_size: int


class FinishEpisode(BaseModel):
    """`POST /v1/episodes/{episode_id}/finish`: close an episode."""

    model_config = ConfigDict(extra="forbid")

    reward: FiniteFloat | None = None
    """The episode's reward; null = the configured reward function scores its policy text."""
    metadata: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=65_536)]] = Field(
        default_factory=dict, max_length=64
    )
    """Added to the group's metadata."""


class EpisodeFinished(BaseModel):
    """A closed episode; `group_complete` once every episode of its group has ended (the group is pushed)."""

    episode_id: str
    group_id: str
    group_complete: bool
