"""Reading a version ahead of its load (`reload.prefetch`), the weights root, and the merged verify knob.

Hermetic: a fake engine that records its pauses and what it was given to load; real files."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading

import pytest
from prometheus_client import CollectorRegistry

import offpolicy.actors.transport.verify as manifest_mod
from offpolicy.actors.config import ReloadConfig, RetryConfig, load_config
from offpolicy.actors.errors import WeightLoadError
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.transport.prefetch import Cancelled, prefetch_folder
from offpolicy.actors.transport.weight_sync import WeightSync, weights_path
from offpolicy.weights.manifest import file_sha256, write_manifest
from offpolicy.weights.record import PolicyRecord


class Engine:
    """Records the order of pauses and loads, and the bytes of the folder it loads, read in the pause."""

    kind = "full"

    def __init__(self):
        self.loaded_version, self.loaded_path = 0, "/initial"
        self.events: list[str] = []
        self.is_paused = False
        self.read: dict[str, bytes] = {}

    @contextlib.asynccontextmanager
    async def paused(self):
        self.events.append("pause")
        self.is_paused = True
        try:
            yield
        finally:
            self.is_paused = False
            self.events.append("resume")

    async def reload_weights(self, path, version, timeout_s=None, source=None):
        assert self.is_paused
        self.events.append(f"load {path}")
        self.read = {p.name: p.read_bytes() for p in sorted(weights_path(path).glob("*.safetensors"))}
        self.loaded_version, self.loaded_path = version, source or path


def _folder(root, version=1, shards=(b"a" * 5000, b"b" * 7000)):
    folder = root / f"v{version}"
    folder.mkdir(parents=True)
    for i, data in enumerate(shards):
        (folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors").write_bytes(data)
    (folder / "config.json").write_text("{}")
    write_manifest(folder, version)
    sha = json.loads((folder / "manifest.json").read_text())["sha256"]
    return folder, sha


def _sync(engine, **reload):
    registry = CollectorRegistry()
    return WeightSync(None, engine, ReloadConfig(**reload), RetryConfig(), ActorMetrics(registry)), registry


def _bytes(registry, where):
    return registry.get_sample_value("offpolicy_actor_reload_prefetched_bytes_total", {"where": where})


async def test_page_cache_reads_every_file_before_the_pause(tmp_path):
    folder, sha = _folder(tmp_path)
    engine = Engine()
    sync, reg = _sync(engine)  # the default: prefetch page_cache, verify manifest
    record = PolicyRecord(1, str(folder), sha, 0.0)
    assert await sync.prepare(record)
    assert engine.events == []  # read and checked while the engine generates
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert _bytes(reg, "page_cache") == size and _bytes(reg, "memory") == 0
    assert reg.get_sample_value("offpolicy_actor_reload_prefetch_seconds_count") == 1
    assert await sync.load(record)
    assert engine.events == ["pause", f"load {folder}", "resume"]
    assert engine.loaded_path == str(folder) and sync.last_pause_s > 0


async def test_memory_stages_a_verified_copy_and_the_pause_never_reads_the_volume(tmp_path):
    folder, sha = _folder(tmp_path / "volume")
    shm = tmp_path / "shm"
    engine = Engine()
    sync, reg = _sync(engine, prefetch="memory", prefetch_dir=str(shm), verify="full")
    record = PolicyRecord(1, str(folder), sha, 0.0)
    want = {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}
    assert await sync.prepare(record) and engine.events == []
    (staged,) = shm.iterdir()
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in folder.iterdir())
    folder.rename(tmp_path / "gone")  # the volume is away during the pause: the load does not need it
    assert await sync.load(record)
    assert engine.events == ["pause", f"load {staged}", "resume"] and engine.read == want
    assert engine.loaded_path == str(folder)  # what a restore reloads: the published folder, not the copy
    assert list(shm.iterdir()) == []  # the copy is deleted once loaded
    assert _bytes(reg, "memory") > 0 and _bytes(reg, "page_cache") == 0


async def test_memory_over_its_bound_falls_back_to_the_page_cache(tmp_path):
    folder, sha = _folder(tmp_path / "volume")
    engine = Engine()
    sync, reg = _sync(engine, prefetch="memory", prefetch_dir=str(tmp_path / "shm"), prefetch_max_bytes=1000)
    record = PolicyRecord(1, str(folder), sha, 0.0)
    assert await sync.prepare(record) and await sync.load(record)
    assert engine.events[1] == f"load {folder}"
    assert _bytes(reg, "page_cache") > 0 and _bytes(reg, "memory") == 0
    assert not (tmp_path / "shm").exists() or list((tmp_path / "shm").iterdir()) == []


async def test_prefetch_none_reads_nothing_ahead(tmp_path):
    folder, sha = _folder(tmp_path)
    engine = Engine()
    sync, reg = _sync(engine, prefetch="none")
    record = PolicyRecord(1, str(folder), sha, 0.0)
    assert await sync.prepare(record) and await sync.load(record)
    assert _bytes(reg, "page_cache") == 0 and _bytes(reg, "memory") == 0


async def test_full_verify_hashes_each_byte_once_on_the_prefetch_read(tmp_path, monkeypatch):
    folder, sha = _folder(tmp_path)
    hashed = []
    monkeypatch.setattr(manifest_mod, "file_sha256", lambda p: hashed.append(p.name) or file_sha256(p))
    engine = Engine()
    sync, _ = _sync(engine, verify="full", prefetch="memory", prefetch_dir=str(tmp_path / "shm"))
    assert await sync.prepare(PolicyRecord(1, str(folder), sha, 0.0))
    assert hashed == []  # every digest came from the prefetch's own read: no second pass over the files
    # a flipped byte (same size) is caught by that read, before any pause, and no copy is left behind
    sync2, reg = _sync(engine, verify="full", prefetch="memory", prefetch_dir=str(tmp_path / "shm2"))
    shard = next(folder.glob("model-00002*"))
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    assert not await sync2.prepare(PolicyRecord(2, str(folder), sha, 0.0))
    assert reg.get_sample_value("offpolicy_actor_reload_failures_total", {"reason": "checksum"}) == 1
    assert list((tmp_path / "shm2").iterdir()) == [] and "pause" not in engine.events


async def test_a_relative_uri_resolves_under_the_actors_weights_root(tmp_path):
    folder, sha = _folder(tmp_path / "mnt" / "run-a" / "weights")
    engine = Engine()
    sync, _ = _sync(engine, weights_root=str(tmp_path / "mnt"))
    record = PolicyRecord(1, "run-a/weights/v1", sha, 0.0)
    assert await sync.prepare(record) and await sync.load(record)
    assert engine.loaded_path == str(folder)
    # an absolute URI (a learner without a root) is used as it is
    other, sha2 = _folder(tmp_path / "elsewhere", version=2, shards=(b"c" * 100,))
    sync.see(PolicyRecord(2, f"file://{other}", sha2, 1.0))
    assert await sync.maybe_reload() and engine.loaded_path == str(other)


async def test_a_relative_uri_without_a_root_is_refused_naming_the_setting(tmp_path, caplog):
    engine = Engine()
    sync, reg = _sync(engine)
    assert not await sync.prepare(PolicyRecord(1, "run-a/weights/v1", "0" * 64, 0.0))
    assert reg.get_sample_value("offpolicy_actor_reload_failures_total", {"reason": "missing"}) == 1
    assert "reload.weights_root" in caplog.text
    with pytest.raises(ValueError, match="climbs out"):
        weights_path("../etc/v1", str(tmp_path))


def test_verify_sha256_is_refused_naming_reload_verify(tmp_path):
    path = tmp_path / "actor.yaml"
    path.write_text("model_path: /m\ngateway: {enabled: true}\nreload: {verify_sha256: false}\n")
    with pytest.raises(ValueError, match=r"verify_sha256.*reload\.verify.*verify: none"):
        load_config(path, {})
    path.write_text("model_path: /m\ngateway: {enabled: true}\nreload: {verify: none}\n")
    assert load_config(path, {}).reload.verify == "none"


def test_sha256_of_shards_is_the_sha256_of_their_listing(tmp_path):
    folder, sha = _folder(tmp_path)
    lines = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
        for p in sorted(folder.glob("*.safetensors"))
    )
    assert sha == hashlib.sha256(lines.encode()).hexdigest()


async def test_ready_prepares_in_the_background_and_hands_over_the_newest_version(tmp_path):
    """`ready` never waits: the first call starts the read, a later one hands over the prepared record;
    a version superseded while it was read is dropped (its staged copy too) and the newest one read."""
    v1, sha1 = _folder(tmp_path / "volume", version=1)
    v2, sha2 = _folder(tmp_path / "volume", version=2, shards=(b"z" * 3000,))
    shm = tmp_path / "shm"
    engine = Engine()
    sync, _ = _sync(engine, prefetch="memory", prefetch_dir=str(shm))
    woken = asyncio.Event()
    sync.see(PolicyRecord(1, str(v1), sha1, 1.0))
    assert sync.ready(on_done=woken.set) is None  # started, not waited for
    await asyncio.wait_for(woken.wait(), 10)
    assert len(list(shm.iterdir())) == 1  # v1 staged
    sync.see(PolicyRecord(2, str(v2), sha2, 2.0))  # published while v1 was read
    woken.clear()
    assert sync.ready(on_done=woken.set) is None  # v1 dropped, v2 started
    await asyncio.wait_for(woken.wait(), 10)
    record = sync.ready()
    assert record is not None and record.version == 2
    (staged,) = shm.iterdir()
    assert staged.name.endswith("-v2") and engine.events == []
    assert await sync.load(record) and engine.loaded_version == 2 and list(shm.iterdir()) == []
    assert sync.ready() is None  # nothing newer


async def test_close_stops_a_prefetch_under_way_and_leaves_nothing_staged(tmp_path):
    folder, sha = _folder(tmp_path / "volume", shards=(b"a" * (64 << 20),))  # 8 chunks
    shm = tmp_path / "shm"
    engine = Engine()
    sync, reg = _sync(engine, prefetch="memory", prefetch_dir=str(shm), verify="full")
    sync.see(PolicyRecord(1, str(folder), sha, 1.0))
    assert sync.ready() is None
    await sync.close()  # cancels at the next chunk, or finds it done
    assert list(shm.iterdir()) == [] and engine.events == []
    assert _bytes(reg, "memory") == 0  # stopped, not read to the end
    assert reg.get_sample_value("offpolicy_actor_reload_failures_total", {"reason": "checksum"}) == 0
    assert sync.ready() is None and engine.loaded_version == 0


def test_a_cancelled_prefetch_raises_and_removes_its_copy(tmp_path):
    folder, sha = _folder(tmp_path / "volume", shards=(b"a" * (20 << 20),))
    cancel = threading.Event()
    cancel.set()
    config = ReloadConfig(prefetch="memory", prefetch_dir=str(tmp_path / "shm"))
    with pytest.raises(Cancelled):
        prefetch_folder(folder, sha, 1, config, cancel)
    assert list((tmp_path / "shm").iterdir()) == []


def test_an_older_learners_format_1_folder_still_verifies(tmp_path):
    """Format 1: the shards' record checksum was the sha256 of their concatenation; the per-file entries
    are the same. Both checks accept it, and `full` still catches a flipped byte."""
    folder, _ = _folder(tmp_path)
    doc = json.loads((folder / "manifest.json").read_text())
    shards = sorted(folder.glob("*.safetensors"))
    doc["format"], doc["sha256"] = 1, hashlib.sha256(b"".join(p.read_bytes() for p in shards)).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(doc))
    for mode in ("manifest", "full"):
        assert manifest_mod.verify_folder(folder, doc["sha256"], 1, mode) == mode
    data = bytearray(shards[0].read_bytes())
    data[0] ^= 1
    shards[0].write_bytes(bytes(data))
    with pytest.raises(WeightLoadError, match="the manifest says"):
        manifest_mod.verify_folder(folder, doc["sha256"], 1, "full")
    doc["format"] = 3
    (folder / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(WeightLoadError, match="unknown format"):
        manifest_mod.verify_folder(folder, doc["sha256"], 1, "manifest")
