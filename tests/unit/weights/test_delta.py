"""Delta versions (`publish.delta`): the codec bit for bit, the learner's full-or-delta choice, the actor's
chain built from the volume, corrupt and missing links, and the retention that keeps a chain loadable."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from offpolicy.actors.config import ReloadConfig, RetryConfig
from offpolicy.actors.errors import WeightLoadError
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.transport.delta_chain import DeltaChain
from offpolicy.actors.transport.weight_sync import WeightSync
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.persist.delta_versions import DeltaVersions
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.learner.persist.version_folders import prune_versions, version_dir
from offpolicy.weights.delta import DELTA_INDEX, DELTA_WEIGHTS, DeltaMismatch, apply, encode, manifest_base
from tests.unit.learner.persist.test_file_generation_uri import _Engine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.3, 1.0])
def test_a_change_applies_bit_for_bit(dtype, share):
    """Values compared as bit patterns: NaN, -0.0 and +0.0 are changes like any; sparse below a third of
    the values changed, xor above; `same` when nothing changed."""
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(4096, generator=g) * 100).to(dtype)
    new = old.clone()
    hit = torch.rand(4096, generator=g) < share
    new[hit] = (torch.randn(int(hit.sum()), generator=g) * 100).to(dtype)
    if dtype.is_floating_point and share > 0:
        new[0], old[1], new[1] = float("nan"), 0.0, -0.0
    enc = encode(old, new)
    got = apply(old, enc.encoding, enc.changed, enc.payload)
    assert np.array_equal(got.view(torch.uint8).numpy(), new.view(torch.uint8).numpy())
    changed = int((old.view(torch.uint8) != new.view(torch.uint8)).reshape(4096, -1).any(1).sum())
    assert enc.changed == changed
    size = old.element_size()
    sparse = changed * (4 + size) < 4096 * size  # positions (uint32) + values below the dense xor's bytes
    assert enc.encoding == ("same" if changed == 0 else "sparse" if sparse else "xor")
    assert share not in (0.001, 1.0) or enc.encoding == {0.001: "sparse", 1.0: "xor"}[share]


def test_a_corrupt_payload_is_refused():
    old = torch.zeros(1000, dtype=torch.bfloat16)
    new = old.clone()
    new[::7] = 1.0
    enc = encode(old, new)
    with pytest.raises(DeltaMismatch):
        apply(old, enc.encoding, enc.changed, enc.payload[:-3])
    with pytest.raises(DeltaMismatch):
        apply(old, enc.encoding, enc.changed + 1, enc.payload)
    with pytest.raises(DeltaMismatch):
        apply(old[:10], enc.encoding, enc.changed, enc.payload)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=64, num_heads=1, num_layers=2)


def _train(model, opt, g) -> None:
    """One AdamW step with random gradients: every weight moves by about the learning rate."""
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _published(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in unique_state(model).items()}


def _same(folder: Path, want: dict[str, torch.Tensor]) -> bool:
    got = {}
    for f in folder.glob("*.safetensors"):
        got |= load_file(f)
    return sorted(got) == sorted(want) and all(
        torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want
    )


@pytest.mark.parametrize(
    ("full_every", "versions"), [(10, 50), (100, 51)], ids=["full-every-10", "50-deltas"]
)
def test_delta_versions_build_bit_equal_on_the_actor(model_dir, tmp_path, full_every, versions):
    """At lr 1e-4: every `full_every`-th version whole, the others deltas much smaller than a full one;
    the actor's folder built from each is bit-equal to the learner's bf16 weights (50 deltas in a row
    with `full_every` 100); the newest full version and its chain stay on the volume whatever
    `keep_versions` says, and an actor holding nothing (behind, restarting) builds the last version from
    them alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    deltas = DeltaVersions("on", full_every=full_every, share=0.25)
    wdir, chain = tmp_path / "w", DeltaChain(tmp_path / "actor")
    for v in range(versions):
        record = publish_weights(model, wdir, v, dtype=torch.bfloat16, keep_versions=3, delta=deltas)
        folder = version_dir(wdir, v)
        if v % full_every == 0:
            assert manifest_base(folder) is None and (folder / "model.safetensors").is_file()
        else:
            assert manifest_base(folder) == v - 1 and not (folder / "model.safetensors").exists()
            assert deltas.last["bytes"] < 0.5 * deltas.last["full_bytes"]
            assert 0 < deltas.last["changed_share"] < 1
        want = _published(model)
        got = chain.build(folder, record.sha256, v) if v % full_every else None
        if got is not None:
            assert _same(got.folder, want), v
            assert (got.folder / "config.json").is_file()
            chain.keep_only(got.folder)
        _train(model, opt, g)
    last, root = versions - 1, (versions - 1) // full_every * full_every
    assert sorted(int(p.name[1:]) for p in wdir.iterdir()) == list(range(min(root, last - 2), versions))
    fresh = DeltaChain(tmp_path / "fresh")  # holds nothing: starts from the newest full version
    doc = json.loads((version_dir(wdir, last) / "manifest.json").read_text())
    built = fresh.build(version_dir(wdir, last), doc["sha256"], last)
    assert fresh.applied == last - root
    assert _same(built.folder, want)


def test_auto_writes_a_version_whole_when_its_delta_passes_the_share(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # most bf16 values change
    g = torch.Generator().manual_seed(2)
    deltas = DeltaVersions("auto", full_every=10, share=0.05)
    publish_weights(model, tmp_path, 0, dtype=torch.bfloat16, delta=deltas)
    _train(model, opt, g)
    publish_weights(model, tmp_path, 1, dtype=torch.bfloat16, delta=deltas)
    assert manifest_base(version_dir(tmp_path, 1)) is None and deltas.chain == 0
    assert _same(version_dir(tmp_path, 1), _published(model))
    publish_weights(model, tmp_path, 2, dtype=torch.bfloat16, delta=deltas)  # nothing changed: a delta
    assert manifest_base(version_dir(tmp_path, 2)) == 1


def test_a_failed_write_leaves_no_base(model_dir, tmp_path, monkeypatch):
    """A version whose write fails is never the base of a delta: the next version is written whole."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    deltas = DeltaVersions("on", full_every=10, share=1.0)
    publish_weights(model, tmp_path, 0, dtype=torch.bfloat16, delta=deltas)
    import offpolicy.learner.persist.delta_versions as dv

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dv, "write_safetensors", full_disk)
    with pytest.raises(OSError):
        publish_weights(model, tmp_path, 1, dtype=torch.bfloat16, delta=deltas)
    monkeypatch.undo()
    assert deltas.base_version is None
    publish_weights(model, tmp_path, 2, dtype=torch.bfloat16, delta=deltas)
    assert manifest_base(version_dir(tmp_path, 2)) is None


def _sync(tmp_path, engine) -> tuple[WeightSync, ActorMetrics]:
    metrics = ActorMetrics(CollectorRegistry())
    cfg = ReloadConfig(verify="manifest", delta_dir=str(tmp_path / "actor"))
    return WeightSync(None, engine, cfg, RetryConfig(), metrics), metrics


def _load(sync, record) -> bool:
    async def run():
        return await sync.prepare(record) and await sync.load(record)

    return asyncio.run(run())


def test_the_actor_loads_delta_versions_and_a_corrupt_one_heals_at_the_next_full(model_dir, tmp_path):
    """WeightSync loads each delta version from the folder it built (the engine never reads a delta
    folder); a corrupt delta is refused by checksum and counted, the engine keeps its version, and the
    next full version loads."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(3)
    deltas = DeltaVersions("on", full_every=4, share=1.0)
    engine = _Engine()
    sync, metrics = _sync(tmp_path, engine)
    wdir = tmp_path / "w"
    records = []
    for v in range(4):
        records.append(publish_weights(model, wdir, v, dtype=torch.bfloat16, delta=deltas))
        _train(model, opt, g)
    for v in range(3):
        assert _load(sync, records[v]), v
        assert engine.loaded_version == v
    assert Path(engine.loaded_path).parent == sync.deltas.root  # a built folder
    assert [p.name for p in sync.deltas.root.iterdir()] == ["v2"]  # the held one alone
    # v3's delta corrupted on the volume, its manifest rewritten to match (a wrong base, a bad link)
    folder = version_dir(wdir, 3)
    index = json.loads((folder / DELTA_INDEX).read_text())
    index["tensors"][0]["sha256"] = "0" * 64
    (folder / DELTA_INDEX).write_text(json.dumps(index))
    from offpolicy.weights.manifest import write_manifest

    manifest = json.loads((folder / "manifest.json").read_text())
    write_manifest(folder, 3)
    doc = json.loads((folder / "manifest.json").read_text())
    doc["base"] = manifest["base"]
    (folder / "manifest.json").write_text(json.dumps(doc))
    assert not _load(sync, records[3])
    assert engine.loaded_version == 2
    assert metrics.reload_failures.labels("checksum")._value.get() == 1
    records.append(publish_weights(model, wdir, 4, dtype=torch.bfloat16, delta=deltas))  # full (4 = 0 mod 4)
    assert manifest_base(version_dir(wdir, 4)) is None
    assert _load(sync, records[4]) and engine.loaded_version == 4
    assert _same(Path(engine.loaded_path), _published(model))


def test_a_missing_link_is_reported_not_guessed(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    deltas = DeltaVersions("on", full_every=10, share=1.0)
    records = [
        publish_weights(model, tmp_path / "w", v, dtype=torch.bfloat16, delta=deltas) for v in range(3)
    ]
    import shutil

    shutil.rmtree(version_dir(tmp_path / "w", 1))
    with pytest.raises(WeightLoadError, match="v1 is gone") as e:
        DeltaChain(tmp_path / "a").build(version_dir(tmp_path / "w", 2), records[2].sha256, 2)
    assert e.value.reason == "missing"


def test_pruning_keeps_the_chain_from_the_newest_full_version(tmp_path):
    for v in range(7):
        folder = version_dir(tmp_path, v)
        folder.mkdir()
        doc = {"format": 2, "version": v, "sha256": "x", "files": {}}
        if v not in (0, 3):
            doc["base"] = v - 1
        (folder / "manifest.json").write_text(json.dumps(doc))
    assert prune_versions(tmp_path, keep=2, protect=6) == [0, 1, 2]
    assert sorted(int(p.name[1:]) for p in tmp_path.iterdir()) == [3, 4, 5, 6]
    assert (version_dir(tmp_path, 3) / "manifest.json").is_file()
    assert not (version_dir(tmp_path, 4) / DELTA_WEIGHTS).exists()  # a test folder: manifests alone


def test_an_actor_killed_mid_build_leaves_nothing_behind_once_restarted(model_dir, tmp_path):
    """A half-built version lives under a hidden name in the actor's own folder (the engine never sees
    it); a restarted actor (another pid) removes the folders of actors no longer running, and leaves a
    live one's alone."""
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"offpolicy-{int(dead.stdout)}"
    (stale / ".tmp-v7-abc").mkdir(parents=True)  # kill -9 mid-build
    (stale / "v6").mkdir()
    live = tmp_path / "offpolicy-1"  # pid 1 runs
    live.mkdir()
    chain = DeltaChain(tmp_path)
    assert chain.removed == [stale.name] and not stale.exists() and live.is_dir()
