"""The actor: vLLM engine wrapper, prompts, rewards, rollout loop, weight reload."""
