"""offpolicy: an asynchronous replay-buffer off-policy RL training service for LLMs."""
