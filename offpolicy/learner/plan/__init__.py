"""What a learner rank needs before any weight loads: its memory plan per rank (`memory`), the `auto`
settings resolved from it (`auto`: checkpointed layers, token budgets) and the host memory plan per node
(`host`)."""
