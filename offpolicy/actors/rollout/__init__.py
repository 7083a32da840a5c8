"""The actor's rollout: the loop, scoring, rewards, environments, episodes, and the way into the buffer."""
