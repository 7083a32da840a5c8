"""The learner's side of the file path: each byte hashed once while a version is written, and
`weights_uri` relative to `publish.weights_root` so that actors may mount the volume elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import types
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from offpolicy.actors.config import ReloadConfig, RetryConfig
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.transport.weight_sync import WeightSync
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.persist.file_generation import (
    WeightsSnapshot,
    publish_weights,
    snapshot_to_host,
    uri_folder,
    write_version,
)
from offpolicy.weights import safetensors_io
from offpolicy.weights.manifest import read_manifest, weights_sha256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=64, num_heads=1, num_layers=2)
    return AutoModelForCausalLM.from_pretrained(folder)


class _Engine:
    loaded_version, loaded_path, kind = 0, "/init", "full"

    @contextlib.asynccontextmanager
    async def paused(self):
        yield

    async def reload_weights(self, path, version, timeout_s=None, source=None):
        assert Path(path, "model.safetensors").is_file()
        self.loaded_version, self.loaded_path = version, source or path


class _Counting:
    """A sha256 that counts the bytes it is fed (all hashers together, in `fed`)."""

    fed = 0

    def __init__(self, data: bytes = b""):
        self._h = hashlib.sha256()
        self.update(data)

    def update(self, data) -> None:
        _Counting.fed += memoryview(data).nbytes
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 40_000])
def test_writing_a_version_hashes_each_byte_once(model, tmp_path, monkeypatch, max_shard_bytes):
    """Every byte written (weights, index, config, manifest) goes through exactly one hasher: with shards
    the record's checksum is combined from their digests, not hashed over the shards again."""
    monkeypatch.setattr(safetensors_io, "hashlib", types.SimpleNamespace(sha256=_Counting))
    _Counting.fed = 0
    snap = WeightsSnapshot(2, snapshot_to_host(unique_state(model), None), model.config, None, torch.float32)
    out = write_version(snap, tmp_path, max_shard_bytes=max_shard_bytes)
    shards = list(out.glob("*.safetensors"))
    assert len(shards) == 1 if max_shard_bytes > 2**20 else len(shards) > 2
    assert _Counting.fed == sum(p.stat().st_size for p in out.iterdir())
    assert read_manifest(out)["sha256"] == weights_sha256(out)  # and it is still the record's checksum


def test_a_relative_uri_loads_where_the_actor_mounts_the_volume(model, tmp_path):
    """The learner publishes under its mount; the volume is seen at another path by the actor."""
    learner_mnt = tmp_path / "learner-mnt"
    record = publish_weights(model, learner_mnt / "run-a" / "weights", 3, weights_root=learner_mnt)
    assert record.weights_uri == "run-a/weights/v3"
    assert uri_folder(record.weights_uri, learner_mnt) == learner_mnt / "run-a" / "weights" / "v3"
    actor_mnt = tmp_path / "actor-mnt"
    learner_mnt.rename(actor_mnt)  # the learner's path no longer exists: only the actor's does

    for root, ok in [(str(actor_mnt), True), (None, False), (str(tmp_path / "elsewhere"), False)]:
        engine = _Engine()
        sync = WeightSync(
            None, engine, ReloadConfig(verify="full", weights_root=root), RetryConfig(),
            ActorMetrics(CollectorRegistry()),
        )  # fmt: skip

        async def run(sync=sync):
            return await sync.prepare(record) and await sync.load(record)

        assert asyncio.run(run()) is ok
        assert engine.loaded_version == (3 if ok else 0)
        if ok:
            assert engine.loaded_path == str(actor_mnt / "run-a" / "weights" / "v3")


def test_a_folder_outside_the_root_is_refused_before_anything_is_written(model, tmp_path):
    with pytest.raises(ValueError, match=r"not under publish\.weights_root"):
        publish_weights(model, tmp_path / "weights", 1, weights_root=tmp_path / "mnt")
    assert not (tmp_path / "weights").exists()
    # without a root the record holds the absolute path, as records always did
    record = publish_weights(model, tmp_path / "weights", 1)
    assert Path(record.weights_uri).is_absolute() and Path(record.weights_uri).is_dir()


def test_the_learner_config_refuses_a_weights_dir_outside_its_root(tmp_path):
    ok = {"model_path": "/m", "publish": {"weights_dir": str(tmp_path / "mnt" / "w")}}
    ok["publish"]["weights_root"] = str(tmp_path / "mnt")
    assert LearnerConfig.model_validate(ok).publish.weights_root == str(tmp_path / "mnt")
    bad = {"model_path": "/m", "publish": {"weights_dir": "/elsewhere/w", "weights_root": str(tmp_path)}}
    with pytest.raises(ValidationError, match=r"publish.weights_dir=.*not under publish.weights_root"):
        LearnerConfig.model_validate(bad)
