"""Weights from the learner to the actor's vLLM engine: the receiving side of `reload.transport: vllm`."""
