"""The policy record (which weights to load) in Redis: the learner publishes it, the actors watch it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Literal

import redis

from offpolicy.buffer.errors import InvalidTrajectory
from offpolicy.buffer.keys import PolicyKeys
from offpolicy.buffer.storage import async_client, call_async, call_sync, script_source, sync_client

POLICY_SCHEMA_VERSION = 1
PolicyKind = Literal["full", "lora"]
POLICY_KINDS: tuple[PolicyKind, ...] = ("full", "lora")


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    """A published policy: its version (optimizer steps), where its weights are, their checksum, and what
    the folder holds: `full` weights (safetensors + config + tokenizer, loaded in place of the engine's) or
    a `lora` adapter (`adapter_model.safetensors` + `adapter_config.json`, served on the unchanged base
    model). A record without `kind` (an older learner's) is `full`; the schema version stays 1."""

    version: int
    weights_uri: str  # e.g. file:///weights/v12 or a path; what actors pass to their weight loader
    sha256: str  # hex sha256 of the safetensors files (`combine_sha256`)
    published_at: float  # unix seconds
    kind: PolicyKind = "full"

    def encode(self) -> str:
        """JSON with a schema version (no pickle)."""
        return json.dumps({"schema_version": POLICY_SCHEMA_VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def decode(cls, data: bytes | str) -> PolicyRecord:
        """Parse and check a record; a malformed one raises `InvalidTrajectory` naming the field."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidTrajectory("policy", f"not JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("schema_version") != POLICY_SCHEMA_VERSION:
            raise InvalidTrajectory("policy.schema_version", f"unknown policy schema in {str(data)[:200]}")
        for name, types in (
            ("version", int),
            ("weights_uri", str),
            ("sha256", str),
            ("published_at", (int, float)),
        ):
            if not isinstance(doc.get(name), types) or isinstance(doc.get(name), bool):
                raise InvalidTrajectory(f"policy.{name}", f"missing or wrong type: {doc.get(name)!r}")
        kind = doc.get("kind", "full")
        if kind not in POLICY_KINDS:
            raise InvalidTrajectory("policy.kind", f"{kind!r} is not one of {', '.join(POLICY_KINDS)}")
        return cls(doc["version"], doc["weights_uri"], doc["sha256"], float(doc["published_at"]), kind)


def _noop() -> None:
    return None


class _PolicyHandle:
    """What both stores hold: the run's policy keys, a Redis client of their kind and the publish script."""

    _make_client = staticmethod(sync_client)

    def __init__(
        self, redis_url: str, run_id: str, storage_timeout_s: float = 5.0, socket_timeout_s: float = 10.0
    ):
        self.keys = PolicyKeys.for_run(run_id)
        self._timeout_s = storage_timeout_s
        self._client = self._make_client(redis_url, socket_timeout_s)
        self._publish = self._client.register_script(script_source("publish_policy"))


class PolicyStore(_PolicyHandle):
    """Synchronous access to a run's policy record (the learner publishes with it)."""

    def publish(self, record: PolicyRecord) -> int:
        """SET the record and PUBLISH it in one atomic step; returns how many subscribers heard it."""
        args = [record.encode(), self.keys.channel]
        return int(
            call_sync(lambda: self._publish([self.keys.record], args), self._timeout_s, "publish", _noop)
        )

    def read(self) -> PolicyRecord | None:
        """The current record, or None when nothing was published yet."""
        raw = call_sync(lambda: self._client.get(self.keys.record), self._timeout_s, "read policy", _noop)
        return None if raw is None else PolicyRecord.decode(raw)

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


class AsyncPolicyStore(_PolicyHandle):
    """Asyncio access to a run's policy record; `watch()` yields each new record (the actors' side)."""

    _make_client = staticmethod(async_client)

    async def publish(self, record: PolicyRecord) -> int:
        """See `PolicyStore.publish`."""
        args = [record.encode(), self.keys.channel]
        raw = await call_async(
            lambda: self._publish([self.keys.record], args), self._timeout_s, "publish", _noop
        )
        return int(raw)

    async def read(self) -> PolicyRecord | None:
        """See `PolicyStore.read`."""
        raw = await call_async(
            lambda: self._client.get(self.keys.record), self._timeout_s, "read policy", _noop
        )
        return None if raw is None else PolicyRecord.decode(raw)

    async def watch(self, poll_interval_s: float = 1.0) -> AsyncIterator[PolicyRecord]:
        """Yield the current record (if any), then every record whose version differs from the last one.

        Listens on the announce channel and also reads the record every `poll_interval_s` when no
        announcement came (pub/sub is fire-and-forget: a reconnect can miss one). While pub/sub is down
        it keeps polling; a read that cannot reach Redis within the bound raises `StorageUnavailable`.
        """
        last: int | None = None
        pubsub = None
        try:
            pubsub = await self._subscribe()
            record = await self.read()  # after subscribing, so nothing published in between is missed
            while True:
                if asyncio.current_task().cancelling():  # redis-py's read timeout can swallow a cancel
                    raise asyncio.CancelledError
                if record is not None and record.version != last:
                    last = record.version
                    yield record
                record = None
                if pubsub is None:
                    pubsub = await self._subscribe()
                if pubsub is not None:
                    try:
                        msg = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=poll_interval_s
                        )
                    except (redis.ConnectionError, redis.TimeoutError):
                        await pubsub.aclose()
                        pubsub = None
                        msg = None
                    if msg is not None:
                        record = PolicyRecord.decode(msg["data"])
                if record is None:
                    record = await self.read()
                    if pubsub is None:  # polling only: pace the loop ourselves
                        await asyncio.sleep(poll_interval_s)
        finally:
            if pubsub is not None:
                await pubsub.aclose()

    async def _subscribe(self):
        pubsub = self._client.pubsub()
        try:
            await pubsub.subscribe(self.keys.channel)
        except (redis.ConnectionError, redis.TimeoutError):
            await pubsub.aclose()
            return None
        return pubsub

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()
