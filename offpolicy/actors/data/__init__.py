"""The actor's data: dataset sources, prompts, the held-out evaluation, the toy datasets, preview."""
