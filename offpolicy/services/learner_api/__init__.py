"""The learner service: REST control plane around the train loop."""
