"""Response models of the actor service's `GET /v1/status`."""

from __future__ import annotations

from pydantic import BaseModel


class ActorStatus(BaseModel):
    """What the actor is doing: its loaded weights, throughput and output."""

    state: str
    """`starting` (engine loading), `running`, `stopped` or `failed`."""
    actor_id: str
    """This actor's id, as stamped on its groups."""
    loaded_policy_version: int | None
    """Policy version of the weights in the engine; null before the first load."""
    learner_policy_version: int | None
    """Newest version the learner published (from the policy record); null when none yet."""
    tokens_per_s: float | None
    """Generated tokens per second over the last batch; null before the first batch."""
    groups_pushed: int
    """Groups inserted into the buffer since start."""
    reloads: int
    """Weight reloads done since start."""
    error: str | None = None
    """Why the loop stopped, when it failed."""
