"""`WeightSync`: watch the learner's policy record and load newer weights into the running engine.

`watch()` runs beside the rollout loop and keeps `latest` up to date (pub/sub with polling fallback,
from `AsyncPolicyStore.watch`; Redis outages are waited out, bounded and counted). The loop asks
`pending()` whether a newer version waits; `prepare()` checks its folder (`reload.verify`:
actors/transport/verify.py) and reads it ahead (`reload.prefetch`: actors/transport/prefetch.py), both while
the engine
generates; `load()` loads it in place while the engine's scheduler is paused (the pause covers only the
load into the engine), and only then moves `loaded_version`. A `weights_uri` relative to the learner's
`publish.weights_root` is resolved under `reload.weights_root`; an absolute one is used as it is.
A failed load is logged and counted by reason, tried again later up to `max_attempts` per version, and
the engine keeps the version it really holds. After an engine-side failure (the weights may be half
loaded) the last good folder is loaded back before the engine resumes.

A record of kind `lora` (a LoRA learner's adapter) is loaded by an engine serving adapters (`engine.lora`)
as a new adapter, without a pause: requests in flight finish on theirs (actors/engine/vllm.py). A record
whose kind is not the engine's is refused, never loaded (`PolicyKindMismatch`, logged once per version and
counted as `reload_failures{reason="kind"}`): the engine keeps what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from offpolicy.actors.errors import PolicyKindMismatch, WeightLoadError
from offpolicy.actors.transport.delta_chain import DeltaChain, is_delta
from offpolicy.actors.transport.prefetch import Cancelled, Prefetched, prefetch_folder
from offpolicy.buffer.errors import InvalidTrajectory, StorageUnavailable

if TYPE_CHECKING:
    from offpolicy.actors.config import ReloadConfig, RetryConfig
    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.weights.record import AsyncPolicyStore, PolicyRecord

log = logging.getLogger(__name__)


class ReloadableEngine(Protocol):
    """What weight sync needs from `VLLMEngine`."""

    loaded_version: int
    loaded_path: str
    kind: str  # what the engine loads: "full" weights, or "lora" adapters (engine.lora)

    def paused(self) -> AbstractAsyncContextManager[None]: ...
    async def reload_weights(
        self, path: str, version: int, timeout_s: float | None = None, source: str | None = None
    ) -> None: ...
    async def load_adapter(self, path: str, version: int, timeout_s: float | None = None) -> None: ...


def weights_path(uri: str, weights_root: str | None = None) -> Path:
    """The local folder of a `weights_uri` (`file:///x` or a plain path): an absolute one as it is, a
    relative one under `weights_root` (`ValueError` without a root, or when it climbs out with `..`)."""
    path = Path(uri.removeprefix("file://"))
    if path.is_absolute():
        return path
    if weights_root is None:
        raise ValueError(
            f"weights_uri {uri!r} is relative to the learner's publish.weights_root: set reload.weights_root "
            "to where this actor mounts the weights volume"
        )
    if ".." in path.parts:
        raise ValueError(f"weights_uri {uri!r} climbs out of the weights root")
    return Path(weights_root) / path


class WeightSync:
    """The actor's view of the policy record and the reload logic around one engine."""

    def __init__(
        self,
        store: AsyncPolicyStore,
        engine: ReloadableEngine,
        config: ReloadConfig,
        retry: RetryConfig,
        metrics: ActorMetrics,
    ) -> None:
        self.store, self.engine, self.config, self.retry, self.metrics = store, engine, config, retry, metrics
        self.latest: PolicyRecord | None = None
        self.reloads = 0
        self.last_prefetch_s = self.last_pause_s = 0.0  # of the last prepared / loaded version
        self._prefetched: Prefetched | None = None  # the prepared version, read ahead, until loaded
        self._preparing: tuple[PolicyRecord, asyncio.Task[bool]] | None = None  # `ready`'s background prepare
        self._cancel = threading.Event()  # set by `close`: a prefetch under way stops at its next chunk
        self._failed: dict[int, int] = {}  # version -> failed attempts
        self.refused: PolicyKindMismatch | None = None  # the newest record refused for its kind
        self.deltas = DeltaChain(config.delta_dir)  # delta versions: the full folders built for the engine
        metrics.policy_version.set(engine.loaded_version)

    # --- watching

    def see(self, record: PolicyRecord) -> None:
        """Note a record from the store: the most recently published one wins. Its version may be lower
        than the last one's: a learner that resumed from an older checkpoint re-publishes the weights it
        holds under their own version, and the actor follows it back (a late announcement of an older
        publish, with an older `published_at`, is ignored)."""
        newer = self.latest is None or (record.published_at, record.version) > (
            self.latest.published_at,
            self.latest.version,
        )
        if newer:
            self.latest = record
            self.metrics.learner_version.set(record.version)
            self._update_lag()

    async def watch(self) -> None:
        """Keep `latest` current until cancelled; Redis outages are waited out with bounded backoff."""
        delay = self.retry.initial_s
        while True:
            try:
                async for record in self.store.watch(self.config.poll_interval_s):
                    self.see(record)
                    delay = self.retry.initial_s
            except StorageUnavailable as e:
                self.metrics.failures.labels("redis_unavailable").inc()
                log.warning("policy record unreachable (%s); retrying in %.1f s", e, delay)
            except InvalidTrajectory as e:
                self.metrics.reload_failures.labels("missing").inc()
                log.error("malformed policy record (%s); retrying in %.1f s", e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry.max_s)

    async def catch_up(self, stop: threading.Event) -> None:
        """Before the first request: read the policy record and load its version when the engine holds
        another, so an actor that starts or restarts, and a run (re)added to a pool, generates from its
        learner's newest policy (its newest adapter, or the base when it has none), not from the base.
        Redis outages are waited out (bounded waits, counted) until the record is read or `stop` is set; a
        load that fails is counted like any (`reload_failures`) and the loop starts on what the engine
        holds, which its tokens are stamped with."""
        delay = self.retry.initial_s
        while True:
            try:
                record = await self.store.read()
                break
            except StorageUnavailable as e:
                self.metrics.failures.labels("redis_unavailable").inc()
                log.warning(
                    "policy record unreachable before the first request (%s); retrying in %.1f s", e, delay
                )
            except InvalidTrajectory as e:
                self.metrics.reload_failures.labels("missing").inc()
                log.error("malformed policy record (%s): starting on v%d", e, self.engine.loaded_version)
                return
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline:  # the stop flag read at least every 0.2 s
                if stop.is_set():
                    return
                await asyncio.sleep(min(0.2, deadline - time.monotonic()))
            delay = min(delay * 2, self.retry.max_s)
        if record is None:
            return  # nothing published: the base is the policy
        self.see(record)
        if self.pending() is not None and not stop.is_set():
            await self.maybe_reload()

    # --- reloading

    @property
    def lag(self) -> int:
        """Learner's newest version minus the loaded one (0 when nothing was published)."""
        return 0 if self.latest is None else max(0, self.latest.version - self.engine.loaded_version)

    def _update_lag(self) -> None:
        self.metrics.policy_lag.set(self.lag)

    def pending(self) -> PolicyRecord | None:
        """The record to load (its version differs from the engine's: newer, or older after a learner's
        rollback), or None (nothing to load, or given up on this version)."""
        record = self.latest
        if record is None:
            return None
        if record.kind != self.engine.kind:
            self._refuse(record)
            return None
        if record.version == self.engine.loaded_version:
            return None
        if self._failed.get(record.version, 0) >= self.config.max_attempts:
            return None  # given up on this version (logged); a newer one is tried as it comes
        return record

    def _refuse(self, record: PolicyRecord) -> None:
        """A record of the other kind than the engine's: logged and counted once per record, not loaded."""
        if self.refused is not None and self.refused.version == record.version:
            return
        self.refused = PolicyKindMismatch(record.version, record.kind, self.engine.kind)
        self.metrics.reload_failures.labels("kind").inc()
        log.error("%s; still generating with v%d", self.refused, self.engine.loaded_version)

    def _fail(self, record: PolicyRecord, e: WeightLoadError) -> None:
        attempts = self._failed[record.version] = self._failed.get(record.version, 0) + 1
        self.metrics.reload_failures.labels(e.reason).inc()
        final = attempts >= self.config.max_attempts
        log.error(
            "weight reload failed (attempt %d/%d%s): %s; still generating with v%d",
            attempts, self.config.max_attempts, ", giving up on this version" if final else "",
            e, self.engine.loaded_version,
        )  # fmt: skip

    async def prepare(self, record: PolicyRecord) -> bool:
        """Check `record`'s folder (`reload.verify`) and read it ahead (`reload.prefetch`) in a thread while
        the engine generates; False (counted) when it fails."""
        self._discard()
        if record.kind != self.engine.kind:
            self._refuse(record)
            return False
        try:
            try:
                folder = weights_path(record.weights_uri, self.config.weights_root)
            except ValueError as e:
                raise WeightLoadError(record.version, "missing", str(e)) from e
            if not folder.is_dir() or not any(folder.glob("*.safetensors")):
                hint = " (the learner's own path: see publish.weights_root)" if folder.is_absolute() else ""
                raise WeightLoadError(record.version, "missing", f"no *.safetensors in {folder}{hint}")
            config = self.config
            if record.kind == "lora" and config.prefetch == "memory":  # vLLM reads the published folder
                config = config.model_copy(update={"prefetch": "page_cache"})
            try:
                if record.kind == "full" and await asyncio.to_thread(is_delta, folder, record.version):
                    # a delta version: its full folder built locally (while the engine generates)
                    got = await asyncio.to_thread(
                        self.deltas.build, folder, record.sha256, record.version, self._cancel
                    )
                else:
                    got = await asyncio.to_thread(
                        prefetch_folder, folder, record.sha256, record.version, config, self._cancel
                    )
            except OSError as e:  # e.g. the learner pruned the folder while it was read
                raise WeightLoadError(record.version, "missing", f"reading {folder}: {e}") from e
        except WeightLoadError as e:
            self._fail(record, e)
            return False
        except Cancelled:
            return False
        self._prefetched, self.last_prefetch_s = got, got.seconds
        self.metrics.reload_prefetch.observe(got.seconds)
        if got.where != "none":
            self.metrics.prefetched_bytes.labels(got.where).inc(got.bytes)
        return True

    def ready(self, on_done: Callable[[], None] | None = None) -> PolicyRecord | None:
        """The version to load once it is prepared, else None; never waits.

        For a pending version it starts `prepare` as a task and returns None: the caller keeps admitting
        prompts while the files are checked and read ahead (seconds to minutes at 7B-70B); `on_done` is
        called when the task ends (the caller's wake-up). A later call returns the record when it
        prepared well and is still the newest published one; a prepared version superseded meanwhile
        (a newer publish, or a learner's rollback) is dropped and the newest one prepared instead."""
        if self._preparing is not None:
            record, task = self._preparing
            if not task.done():
                return None
            self._preparing = None
            if task.result() and record == self.latest and record.version != self.engine.loaded_version:
                return record
            if task.result():
                log.info("v%d was read ahead but is superseded by v%s", record.version, self.latest.version)
            self._discard()
        record = self.pending()
        if record is None:
            return None
        task = asyncio.create_task(self.prepare(record))
        if on_done is not None:
            task.add_done_callback(lambda _: on_done())
        self._preparing = (record, task)
        return None

    async def close(self) -> None:
        """Stop a background prepare (its read stops at the next chunk) and drop any staged copy."""
        self._cancel.set()
        if self._preparing is not None:
            await asyncio.gather(self._preparing[1], return_exceptions=True)
            self._preparing = None
        self._discard()

    def _discard(self) -> None:
        """Drop the prepared version's staged copy, if any (a delta version's built folder too, unless the
        engine holds it)."""
        if self._prefetched is not None:
            self._prefetched.discard()
            if self._prefetched.where == "delta":
                self.deltas.keep_only(self.engine.loaded_path)
            self._prefetched = None

    async def load(self, record: PolicyRecord) -> bool:
        """Load a prepared record with the engine paused; True when the engine moved forward."""
        got = self._prefetched
        if got is None or got.version != record.version:
            raise RuntimeError(f"load(v{record.version}) without a prepare of it")  # a caller's bug
        if record.kind == "lora":
            return await self._load_adapter(record, got)
        t0 = time.perf_counter()
        try:
            async with self.engine.paused():
                try:
                    await self.engine.reload_weights(
                        str(got.load_from), record.version, self.config.timeout_s, source=str(got.folder)
                    )
                except WeightLoadError as e:
                    self._fail(record, e)
                    await self._restore()
                    return False
        finally:
            self._discard()
        self.last_pause_s = time.perf_counter() - t0
        self.reloads += 1
        self.metrics.reloads.inc()
        self.metrics.reload_seconds.observe(self.last_pause_s)
        self.metrics.policy_version.set(self.engine.loaded_version)
        self._update_lag()
        log.info(
            "loaded policy v%d: engine paused %.3f s; %.1f MB read ahead (%s) in %.3f s before the pause",
            record.version, self.last_pause_s, got.bytes / 1e6, got.where, got.seconds,
        )  # fmt: skip
        return True

    async def _load_adapter(self, record: PolicyRecord, got: Prefetched) -> bool:
        """Register a prepared adapter with the engine while it generates (no pause); True when it did.
        The engine reads the published folder, not a staged copy: requests name the adapter's folder, and
        vLLM reads it again whenever the adapter is not in its cache."""
        t0 = time.perf_counter()
        try:
            await self.engine.load_adapter(str(got.folder), record.version, self.config.timeout_s)
        except WeightLoadError as e:
            self._fail(record, e)  # nothing changed in the engine: no restore
            return False
        finally:
            self._discard()
        seconds, self.last_pause_s = time.perf_counter() - t0, 0.0
        self.reloads += 1
        self.metrics.reloads.inc()
        self.metrics.adapter_loads.inc()
        self.metrics.policy_version.set(self.engine.loaded_version)
        self._update_lag()
        log.info(
            "loaded LoRA adapter v%d in %.3f s without pausing the engine; %.1f MB read ahead (%s) in %.3f s",
            record.version, seconds, got.bytes / 1e6, got.where, got.seconds,
        )  # fmt: skip
        return True

    async def maybe_reload(self) -> bool:
        """`prepare` and `load` the pending record, if any; True when the engine moved forward."""
        record = self.pending()
        if record is None or not await self.prepare(record):
            return False
        return await self.load(record)

    async def _restore(self) -> None:
        """Load back the last good weights after an engine-side failure; if that fails too, stop loudly."""
        path, version = self.engine.loaded_path, self.engine.loaded_version
        try:
            await self.engine.reload_weights(path, version, self.config.timeout_s)
        except WeightLoadError as e:
            self.metrics.reload_failures.labels("restore").inc()
            raise WeightLoadError(
                version, "restore", f"could not restore {path} after a failed load: {e}"
            ) from e
        log.warning("restored policy v%d from %s after the failed load", version, path)
