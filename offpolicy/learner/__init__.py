"""The learner: rollout-correction math, losses, advantages, batching, the train loop, weights."""
