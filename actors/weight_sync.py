"""Follow the learner's policy record and load newer weights into the engine between batches.

`follow()` runs beside the rollout loop and keeps `latest` up to date (pub/sub with polling fallback,
from `AsyncPolicyStore.watch`; Redis outages are waited out, bounded and counted). `maybe_reload()` is
called by the loop between batches: when `latest` is newer than the engine's version it checks the
sha256 of the published `*.safetensors`, loads them in place, and only then moves `loaded_version`.
A failed load is logged and counted by reason, tried again at the next batch boundaries up to
`max_attempts` per version, and the actor keeps stamping the version the engine really holds. After an
engine-side failure (the weights may be half loaded) the last good folder is loaded back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from actors.errors import WeightLoadError
from buffer.errors import InvalidTrajectory, StorageUnavailable
from buffer.policy import weights_sha256

if TYPE_CHECKING:
    from actors.config import ReloadConfig, RetryConfig
    from actors.metrics import ActorMetrics
    from buffer.policy import AsyncPolicyStore, PolicyRecord

log = logging.getLogger(__name__)


class ReloadableEngine(Protocol):
    """What weight sync needs from `VLLMEngine`."""

    loaded_version: int
    loaded_path: str

    def reload_weights(self, path: str, version: int, timeout_s: float | None = None) -> None: ...


safetensors_sha256 = weights_sha256
"""The policy record's checksum of a weights folder (`buffer.policy.weights_sha256`), under its old name."""


def weights_path(uri: str) -> Path:
    """The local folder of a `weights_uri` (`file:///x` or a plain path)."""
    return Path(uri.removeprefix("file://"))


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
        self._failed: dict[int, int] = {}  # version -> failed attempts
        metrics.policy_version.set(engine.loaded_version)

    # --- watching

    def see(self, record: PolicyRecord) -> None:
        """Note a record from the store (only ever moves forward)."""
        if self.latest is None or record.version > self.latest.version:
            self.latest = record
            self.metrics.learner_version.set(record.version)
            self._update_lag()

    async def follow(self) -> None:
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

    # --- reloading

    @property
    def lag(self) -> int:
        """Learner's newest version minus the loaded one (0 when nothing was published)."""
        return 0 if self.latest is None else max(0, self.latest.version - self.engine.loaded_version)

    def _update_lag(self) -> None:
        self.metrics.policy_lag.set(self.lag)

    async def maybe_reload(self) -> bool:
        """Load `latest` if it is newer than the engine's weights; True when the engine moved forward."""
        record = self.latest
        if record is None or record.version <= self.engine.loaded_version:
            return False
        if self._failed.get(record.version, 0) >= self.config.max_attempts:
            return False  # given up on this version (logged); a newer one is tried as it comes
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._load, record)
        except WeightLoadError as e:
            attempts = self._failed[record.version] = self._failed.get(record.version, 0) + 1
            self.metrics.reload_failures.labels(e.reason).inc()
            final = attempts >= self.config.max_attempts
            log.error(
                "weight reload failed (attempt %d/%d%s): %s; still generating with v%d",
                attempts, self.config.max_attempts, ", giving up on this version" if final else "",
                e, self.engine.loaded_version,
            )  # fmt: skip
            if e.reason in ("timeout", "engine"):
                await asyncio.to_thread(self._restore)
            return False
        self.reloads += 1
        self.metrics.reloads.inc()
        self.metrics.reload_seconds.observe(time.perf_counter() - t0)
        self.metrics.policy_version.set(self.engine.loaded_version)
        self._update_lag()
        log.info("loaded policy v%d in %.2f s", record.version, time.perf_counter() - t0)
        return True

    def _load(self, record: PolicyRecord) -> None:
        folder = weights_path(record.weights_uri)
        if not folder.is_dir() or not any(folder.glob("*.safetensors")):
            raise WeightLoadError(record.version, "missing", f"no *.safetensors in {folder}")
        if self.config.verify_sha256:
            got = weights_sha256(folder)
            if got != record.sha256:
                raise WeightLoadError(
                    record.version,
                    "checksum",
                    f"sha256 of {folder} is {got}, the record says {record.sha256}",
                )
        self.engine.reload_weights(str(folder), record.version, self.config.timeout_s)

    def _restore(self) -> None:
        """Load back the last good weights after an engine-side failure; if that fails too, stop loudly."""
        path, version = self.engine.loaded_path, self.engine.loaded_version
        try:
            self.engine.reload_weights(path, version, self.config.timeout_s)
        except WeightLoadError as e:
            self.metrics.reload_failures.labels("restore").inc()
            raise WeightLoadError(
                version, "restore", f"could not restore {path} after a failed load: {e}"
            ) from e
        log.warning("restored policy v%d from %s after the failed load", version, path)
