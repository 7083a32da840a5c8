"""The OpenAI-compatible gateway's domain side: episodes that agents run against the actor's engine."""
