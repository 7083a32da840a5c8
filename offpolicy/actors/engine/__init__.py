"""The actor's engine: vLLM's async engine on its own loop, and conversations rendered in tokens."""
