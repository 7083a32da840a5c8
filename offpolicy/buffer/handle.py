"""What `ReplayBuffer` and `AsyncReplayBuffer` hold alike: the core, a Redis client of their kind, the
registered scripts, reconfiguration, and following the learner's table-wide config."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.core import Core
from offpolicy.buffer.storage import script_source, sync_client


class BufferHandle:
    """What both buffers hold: the shared core (config, codec, metrics), a Redis client of their kind and
    the two registered scripts; `reconfigure` is the same for both. `follow_learner` (a producer's, the
    default): an insert reads the learner's table-wide fields (`publish_table`) in its own transaction, at
    most once a second, and the buffer adopts them from its next call; the learner passes False."""

    _make_client = staticmethod(sync_client)

    def __init__(
        self,
        redis_url: str,
        run_id: str,
        config: BufferConfig | None = None,
        registry: CollectorRegistry | None = None,
        follow_learner: bool = True,
    ) -> None:
        self.run_id = run_id
        self._core = Core(run_id, config or BufferConfig(), registry, follow_learner)
        self.config = self._core.cfg
        self._client = self._make_client(redis_url, self.config.socket_timeout_s)
        self._insert = self._client.register_script(script_source("insert"))
        self._sample = self._client.register_script(script_source("sample"))
        self._lease_script = self._client.register_script(script_source("lease"))

    def reconfigure(self, config: BufferConfig) -> None:
        """Apply `config` from the next call on, keeping this object, its connection pool and its metrics
        (same registry); the learner calls it at step boundaries. A new `socket_timeout_s` applies to
        connections opened from then on."""
        self._core.set_config(config)
        self.config = config
        kwargs = self._client.connection_pool.connection_kwargs
        kwargs["socket_timeout"] = kwargs["socket_connect_timeout"] = config.socket_timeout_s

    def _adopt(self, table: bytes | None) -> None:
        """Take the learner's table-wide fields read by an insert (`follow_learner`), from the next call."""
        if self._core.adopt(table):
            self.config = self._core.cfg
