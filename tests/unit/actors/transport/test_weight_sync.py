"""WeightSync's reload rules on a fake engine (hermetic): checksum, bounded retries, restore, stamping."""

from __future__ import annotations

import contextlib
import hashlib
import threading

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ReloadConfig, RetryConfig
from offpolicy.actors.errors import WeightLoadError
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.transport.weight_sync import WeightSync, weights_path
from offpolicy.buffer.errors import StorageUnavailable
from offpolicy.weights.manifest import file_sha256, weights_sha256
from offpolicy.weights.record import PolicyRecord


class FakeEngine:
    """Records reload calls; fails the next `fail` loads with `reason`."""

    kind = "full"

    def __init__(self, fail: int = 0, reason: str = "engine"):
        self.loaded_version, self.loaded_path = 0, "/initial"
        self.calls: list[tuple[str, int]] = []
        self.fail, self.reason = fail, reason
        self.pauses = 0
        self.is_paused = False

    @contextlib.asynccontextmanager
    async def paused(self):
        self.pauses += 1
        self.is_paused = True
        try:
            yield
        finally:
            self.is_paused = False

    async def reload_weights(self, path, version, timeout_s=None, source=None):
        assert self.is_paused, "weights are loaded only while the engine is paused"
        self.calls.append((path, version))
        if self.fail > 0 and path != self.loaded_path:
            self.fail -= 1
            raise WeightLoadError(version, self.reason, "boom")
        self.loaded_version, self.loaded_path = version, source or path


def _publish(tmp_path, version: int, payload: bytes = b"weights") -> PolicyRecord:
    folder = tmp_path / f"v{version}"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(payload)
    return PolicyRecord(version, f"file://{folder}", hashlib.sha256(payload).hexdigest(), 0.0)


def _sync(engine, **reload):
    registry = CollectorRegistry()
    sync = WeightSync(None, engine, ReloadConfig(**reload), RetryConfig(), ActorMetrics(registry))
    return sync, registry


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels or None)


def test_a_file_uri_and_a_plain_path_name_the_same_folder():
    assert weights_path("file:///x/v1") == weights_path("/x/v1")


def test_weights_sha256_combines_the_shards_digests_in_name_order(tmp_path):
    """One file: its own sha256. Shards: the sha256 of their `sha256sum` listing (each byte hashed once)."""
    import shutil
    import subprocess

    (tmp_path / "b.safetensors").write_bytes(b"2" * 3_000_000)  # spans several read chunks
    (tmp_path / "config.json").write_text("{}")  # not hashed
    assert weights_sha256(tmp_path) == hashlib.sha256(b"2" * 3_000_000).hexdigest()
    (tmp_path / "a.safetensors").write_bytes(b"1")
    a, b = hashlib.sha256(b"1").hexdigest(), hashlib.sha256(b"2" * 3_000_000).hexdigest()
    listing = f"{a}  a.safetensors\n{b}  b.safetensors\n"
    assert weights_sha256(tmp_path) == hashlib.sha256(listing.encode()).hexdigest()
    if shutil.which("sha256sum"):  # what the docs say an operator can run
        out = subprocess.run(
            "sha256sum *.safetensors | sha256sum", shell=True, cwd=tmp_path, capture_output=True, text=True
        )
        assert out.stdout.split()[0] == weights_sha256(tmp_path)


async def test_reload_moves_version_and_lag(tmp_path):
    engine = FakeEngine()
    sync, reg = _sync(engine)
    assert await sync.maybe_reload() is False  # nothing published yet
    sync.see(_publish(tmp_path, 3))
    assert _value(reg, "offpolicy_actor_policy_lag_versions") == 3
    assert await sync.maybe_reload() is True
    assert engine.loaded_version == 3 and sync.lag == 0 and sync.reloads == 1
    assert _value(reg, "offpolicy_actor_policy_version") == 3
    assert _value(reg, "offpolicy_actor_policy_lag_versions") == 0
    sync.see(PolicyRecord(2, "/old", "x", 0.0))  # a late announcement of an older publish: ignored
    assert sync.latest.version == 3 and await sync.maybe_reload() is False


class OutageStore:
    """A policy store whose first `outages` reads cannot reach Redis, then answer `record`."""

    def __init__(self, record: PolicyRecord | None, outages: int = 0) -> None:
        self.record, self.outages, self.reads = record, outages, 0

    async def read(self) -> PolicyRecord | None:
        self.reads += 1
        if self.reads <= self.outages:
            raise StorageUnavailable("read policy: connection refused")
        return self.record


def _sync_on(store, engine, **reload):
    registry = CollectorRegistry()
    retry = RetryConfig(initial_s=0.01, max_s=0.02)
    return WeightSync(store, engine, ReloadConfig(**reload), retry, ActorMetrics(registry)), registry


async def test_catching_up_loads_the_newest_published_version_through_an_outage(tmp_path):
    """Before its first request an actor (or a run added to a pool) holds its learner's newest version:
    the record is read through Redis outages (counted), then loaded, and only then does `catch_up` return."""
    engine = FakeEngine()
    store = OutageStore(_publish(tmp_path, 10), outages=2)
    sync, reg = _sync_on(store, engine)
    await sync.catch_up(threading.Event())
    assert (store.reads, engine.loaded_version, engine.calls[-1][1]) == (3, 10, 10)
    assert _value(reg, "offpolicy_actor_failures_total", reason="redis_unavailable") == 2
    assert _value(reg, "offpolicy_actor_policy_version") == 10


async def test_catching_up_with_nothing_published_or_stopped_loads_nothing(tmp_path):
    engine = FakeEngine()
    await _sync_on(OutageStore(None), engine)[0].catch_up(threading.Event())
    stop = threading.Event()
    stop.set()  # stopped while Redis is away: it returns without waiting for the record
    store = OutageStore(_publish(tmp_path, 4), outages=10**6)
    await _sync_on(store, engine)[0].catch_up(stop)
    assert store.reads == 1 and engine.calls == [] and engine.loaded_version == 0


async def test_a_rolled_back_learner_is_followed_back(tmp_path):
    """The learner resumed from its v2 checkpoint after publishing v3: it re-publishes v2 (later), and
    the actor loads it, so the versions it stamps are those of the weights the learner holds."""
    engine = FakeEngine()
    sync, _ = _sync(engine)
    sync.see(_publish(tmp_path, 3))
    assert await sync.maybe_reload() is True and engine.loaded_version == 3
    rolled_back = _publish(tmp_path, 2, b"checkpoint v2")
    sync.see(PolicyRecord(2, rolled_back.weights_uri, rolled_back.sha256, 10.0))
    assert await sync.maybe_reload() is True
    assert engine.loaded_version == 2 and engine.loaded_path.endswith("v2")


async def test_checksum_mismatch_is_loud_and_bounded(tmp_path):
    engine = FakeEngine()
    sync, reg = _sync(engine, max_attempts=2)
    record = _publish(tmp_path, 1)
    sync.see(PolicyRecord(1, record.weights_uri, "0" * 64, 0.0))
    for _ in range(4):
        assert await sync.maybe_reload() is False
    assert engine.calls == []  # the engine was never touched
    assert engine.loaded_version == 0
    assert _value(reg, "offpolicy_actor_reload_failures_total", reason="checksum") == 2


async def test_missing_folder(tmp_path):
    engine = FakeEngine()
    sync, reg = _sync(engine)
    sync.see(PolicyRecord(1, str(tmp_path / "gone"), "0" * 64, 0.0))
    assert await sync.maybe_reload() is False
    assert _value(reg, "offpolicy_actor_reload_failures_total", reason="missing") == 1


async def test_engine_failure_restores_then_a_retry_succeeds(tmp_path):
    engine = FakeEngine(fail=1, reason="timeout")
    sync, reg = _sync(engine, max_attempts=3)
    record = _publish(tmp_path, 5)
    sync.see(record)
    assert await sync.maybe_reload() is False
    folder = str(weights_path(record.weights_uri))
    assert engine.calls == [(folder, 5), ("/initial", 0)]  # failed load, then the old weights back
    assert engine.pauses == 1  # restored within the same pause: nothing ran on half-loaded weights
    assert engine.loaded_version == 0
    assert _value(reg, "offpolicy_actor_reload_failures_total", reason="timeout") == 1
    assert await sync.maybe_reload() is True
    assert engine.loaded_version == 5


async def test_failed_restore_stops_loudly(tmp_path):
    class Broken(FakeEngine):
        async def reload_weights(self, path, version, timeout_s=None, source=None):
            raise WeightLoadError(version, "engine", "dead")

    sync, reg = _sync(Broken())
    sync.see(_publish(tmp_path, 1))
    with pytest.raises(WeightLoadError, match="could not restore"):
        await sync.maybe_reload()
    assert _value(reg, "offpolicy_actor_reload_failures_total", reason="restore") == 1


# --- reload.verify: manifest | full | none


def _published(tmp_path, version: int = 1) -> PolicyRecord:
    from offpolicy.weights.manifest import write_manifest

    record = _publish(tmp_path, version, b"weights-" + bytes([version]) * 1000)
    folder = weights_path(record.weights_uri)
    (folder / "config.json").write_text("{}")
    write_manifest(folder, version)
    return record


def test_write_manifest_covers_every_file_with_the_records_checksum(tmp_path):
    import json

    record = _published(tmp_path)
    folder = weights_path(record.weights_uri)
    doc = json.loads((folder / "manifest.json").read_text())
    assert (doc["format"], doc["version"], doc["sha256"]) == (2, 1, record.sha256)
    assert sorted(doc["files"]) == ["config.json", "model.safetensors"]
    entry = doc["files"]["model.safetensors"]
    data = (folder / "model.safetensors").read_bytes()
    assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_verify_modes_catch_what_they_promise(tmp_path, monkeypatch):
    import offpolicy.actors.transport.verify as manifest

    record = _published(tmp_path)
    folder = weights_path(record.weights_uri)
    hashed = []
    monkeypatch.setattr(manifest, "file_sha256", lambda p: hashed.append(p.name) or file_sha256(p))
    assert manifest.verify_folder(folder, record.sha256, 1, "manifest") == "manifest" and hashed == []
    assert manifest.verify_folder(folder, record.sha256, 1, "full") == "full"
    assert sorted(hashed) == ["config.json", "model.safetensors"]  # each file hashed once
    # same size, other bytes: only a full check sees it
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert manifest.verify_folder(folder, record.sha256, 1, "manifest") == "manifest"
    with pytest.raises(WeightLoadError, match="checksum"):
        manifest.verify_folder(folder, record.sha256, 1, "full")
    assert manifest.verify_folder(folder, "0" * 64, 1, "none") == "none"
    # a truncated file, or a manifest for other weights: caught without hashing
    (folder / "model.safetensors").write_bytes(bytes(data[:-1]))
    with pytest.raises(WeightLoadError, match="bytes"):
        manifest.verify_folder(folder, record.sha256, 1, "manifest")
    with pytest.raises(WeightLoadError, match=r"manifest\.json says sha256"):
        manifest.verify_folder(folder, "0" * 64, 1, "manifest")


def test_a_folder_without_manifest_falls_back_to_a_full_check(tmp_path, caplog):
    from offpolicy.actors.transport.verify import verify_folder

    record = _publish(tmp_path, 2)
    folder = weights_path(record.weights_uri)
    assert verify_folder(folder, record.sha256, 2, "manifest") == "full"
    assert "no manifest.json" in caplog.text
    with pytest.raises(WeightLoadError, match="checksum"):
        verify_folder(folder, "0" * 64, 2, "manifest")


async def test_verify_none_loads_without_checking(tmp_path):
    engine = FakeEngine()
    sync, _ = _sync(engine, verify="none")
    record = _publish(tmp_path, 1)
    sync.see(PolicyRecord(1, record.weights_uri, "0" * 64, 0.0))
    assert await sync.maybe_reload() is True and engine.loaded_version == 1


# --- LoRA adapters (engine.lora) and records of the other kind


class AdapterEngine(FakeEngine):
    """Serves adapters: registers them without a pause (never reloads the base)."""

    kind = "lora"

    def __init__(self, refuse: bool = False):
        super().__init__()
        self.adapters: list[tuple[str, int]] = []
        self.refuse = refuse

    async def load_adapter(self, path, version, timeout_s=None):
        assert not self.is_paused, "an adapter is registered while the engine generates"
        if self.refuse:
            raise WeightLoadError(version, "engine", "LoRA rank 64 is greater than max_lora_rank 16")
        self.adapters.append((path, version))
        self.loaded_version, self.loaded_path = version, path


def _adapter(tmp_path, version: int) -> PolicyRecord:
    record = _publish(tmp_path, version, b"adapter-" + bytes([version]) * 100)
    folder = weights_path(record.weights_uri)
    (folder / "model.safetensors").rename(folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text("{}")
    return PolicyRecord(version, record.weights_uri, record.sha256, float(version), "lora")


async def test_an_adapter_is_registered_without_a_pause_or_a_base_reload(tmp_path):
    engine = AdapterEngine()
    sync, reg = _sync(engine, verify="full", prefetch="memory")
    for version in (1, 2):
        sync.see(_adapter(tmp_path, version))
        assert await sync.maybe_reload() is True
    folder = weights_path(sync.latest.weights_uri)
    assert engine.adapters[-1] == (str(folder), 2)  # the published folder: vLLM may read it again later
    assert engine.pauses == 0 and engine.calls == [] and engine.loaded_version == 2
    assert _value(reg, "offpolicy_actor_adapter_loads_total") == 2
    assert _value(reg, "offpolicy_actor_reloads_total") == 2
    assert _value(reg, "offpolicy_actor_policy_version") == 2 and sync.last_pause_s == 0.0


async def test_a_refused_adapter_is_counted_and_changes_nothing(tmp_path):
    engine = AdapterEngine(refuse=True)
    sync, reg = _sync(engine, max_attempts=2)
    sync.see(_adapter(tmp_path, 1))
    for _ in range(3):
        assert await sync.maybe_reload() is False
    assert engine.calls == [] and engine.loaded_version == 0  # no restore: the engine held on to its own
    assert _value(reg, "offpolicy_actor_reload_failures_total", reason="engine") == 2


@pytest.mark.parametrize("engine_kind", ["full", "lora"])
async def test_a_record_of_the_other_kind_is_refused_and_counted_once(tmp_path, engine_kind):
    engine = FakeEngine() if engine_kind == "full" else AdapterEngine()
    sync, reg = _sync(engine)
    wrong = _adapter(tmp_path, 1) if engine_kind == "full" else _publish(tmp_path, 1)
    sync.see(wrong)
    for _ in range(3):
        assert sync.pending() is None and await sync.maybe_reload() is False
    assert await sync.prepare(wrong) is False
    assert engine.calls == [] and engine.loaded_version == 0 and engine.pauses == 0
    assert _value(reg, "offpolicy_actor_reload_failures_total", reason="kind") == 1
    assert sync.refused is not None and sync.refused.reason == "kind"
    assert f"holds {wrong.kind} weights" in str(sync.refused) and "engine.lora" in str(sync.refused)
    right = _publish(tmp_path, 2) if engine_kind == "full" else _adapter(tmp_path, 2)
    sync.see(PolicyRecord(2, right.weights_uri, right.sha256, 10.0, right.kind))
    assert await sync.maybe_reload() is True and engine.loaded_version == 2  # the right kind loads as ever
