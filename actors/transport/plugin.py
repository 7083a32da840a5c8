"""The project's vLLM plugin (`vllm.general_plugins` entry point `offpolicy`): registers the `gloo`
weight-transfer engine pair in vLLM's factories. vLLM runs it in every process it starts (front end,
engine core, workers); it may run more than once per process, so it is idempotent."""

from __future__ import annotations


def register() -> None:
    """Register `gloo` (worker side and trainer side) unless it already is."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    module = "actors.transport.gloo_engine"
    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", module, "GlooWeightTransferEngine")
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine("gloo", module, "GlooTrainerWeightTransferEngine")
