"""The only HTTP layer: FastAPI apps for the learner and the actor, and the `offpolicy` CLI."""
