"""The transfer receiver's catch-up from files: a relative `weights_uri` (the learner's
`publish.weights_root`) resolves under the actor's own `reload.weights_root`, as the file reload does."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from offpolicy.actors.transport.receiver import TransferReceiver
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.weights.config import TransferConfig


class _Engine:
    loaded_version, loaded_path = 0, "/init"

    @contextlib.asynccontextmanager
    async def paused(self):
        yield

    async def reload_weights(self, path, version, timeout_s=None, source=None):
        assert Path(path, "model.safetensors").is_file()
        self.loaded_version, self.loaded_path = version, path


class _Store:
    def __init__(self, record) -> None:
        self.record = record

    async def read(self):
        return self.record


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=64, num_heads=1, num_layers=2)
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize(("root", "ok"), [("actor-mnt", True), (None, False)])
def test_catch_up_resolves_a_relative_uri_under_the_actors_weights_root(model, tmp_path, root, ok):
    learner_mnt = tmp_path / "learner-mnt"
    record = publish_weights(model, learner_mnt / "run" / "weights", 4, weights_root=learner_mnt)
    assert record.weights_uri == "run/weights/v4"
    learner_mnt.rename(tmp_path / "actor-mnt")  # the actor mounts the volume elsewhere
    engine = _Engine()
    receiver = TransferReceiver(
        None,  # the control plane is not used by a catch-up
        engine,
        _Store(record),
        TransferConfig(backend="gloo"),
        CollectorRegistry(),
        verify="full",
        weights_root=str(tmp_path / root) if root else None,
    )
    assert asyncio.run(receiver._catch_up()) is ok
    assert receiver.caught_up is ok
    if ok:
        assert engine.loaded_version == 4
        assert engine.loaded_path == str(tmp_path / "actor-mnt" / "run" / "weights" / "v4")
    else:  # a relative URI without a root is refused (counted, retried later), never loaded from cwd
        assert engine.loaded_version == 0


def test_catch_up_refuses_a_lora_adapter(model, tmp_path):
    """A LoRA learner's adapter is never loaded as full weights (a transfer group serves full weights)."""
    from offpolicy.learner.config.lora import LoraConfig
    from offpolicy.learner.model import lora

    adapted = lora.inject(
        AutoModelForCausalLM.from_pretrained(model.config.name_or_path), LoraConfig(rank=8), 0
    )
    record = publish_weights(adapted, tmp_path / "weights", 4, lora=LoraConfig(rank=8))
    engine = _Engine()
    registry = CollectorRegistry()
    receiver = TransferReceiver(
        None, engine, _Store(record), TransferConfig(backend="gloo"), registry, verify="full"
    )
    assert asyncio.run(receiver._catch_up()) is False
    assert receiver.caught_up is False and engine.loaded_version == 0
    assert registry.get_sample_value("offpolicy_actor_transfer_failures_total", {"op": "catch_up"}) == 1
