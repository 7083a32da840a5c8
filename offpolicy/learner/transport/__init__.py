"""How a published version reaches the actors (`publish.transport`): files (persist/), or vLLM's
weight-transfer engines (transport/vllm.py) beside durable file generations."""

from offpolicy.learner.transport.base import TransferResult, WeightTransport

__all__ = ["TransferResult", "WeightTransport"]
