"""The actor service: the rollout loop plus health, metrics and status."""
