"""The wire to Redis: clients, the Lua scripts and their transactions, and error translation.

Redis errors become buffer errors here and nowhere else: connection errors and timeouts are retried
with backoff for `storage_timeout_s`, then raise `StorageUnavailable`; any other Redis error raises
`StorageUnavailable` at once, except Redis' own out-of-memory refusal of an insert (`full_on_oom`), which
is back-pressure (`BufferFull`), not an outage. What the scripts take and give back (ARGV, parsed
replies) is buffer/script_io.py.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript, Script
from redis.connection import Encoder, PythonRespSerializer
from redis.exceptions import NoScriptError, OutOfMemoryError
from redis.retry import Retry

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.errors import BufferFull, StorageUnavailable
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.rate_limiter import Backoff
from offpolicy.buffer.script_io import LeaseArgs, SampleReply, insert_args, sample_args

T = TypeVar("T")
SCRIPTS_DIR = Path(__file__).parent / "scripts"
_RETRY_INITIAL_S, _RETRY_MAX_S = 0.01, 0.5
_PACK_CUTOFF_BYTES = 6000  # redis-py's own cutoff: larger arguments go out as their own buffers
_RETRYABLE = (redis.ConnectionError, redis.TimeoutError)  # BusyLoadingError (AOF replay) is a ConnectionError


_PRELUDES = {"insert": ("lib",), "sample": ("lib", "samplers"), "lease": ("lib",)}


def script_source(name: str) -> str:
    """The text of `scripts/<name>.lua`, after the shared parts it uses (`lib.lua`, `samplers.lua`)."""
    parts = (*_PRELUDES.get(name, ()), name)
    return "\n".join((SCRIPTS_DIR / f"{part}.lua").read_text() for part in parts)


def _client_kwargs(socket_timeout_s: float) -> dict:
    # redis-py's own retries (3, with up to 10 s backoff) would break our bound; we retry ourselves.
    return {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }


def sync_client(url: str, socket_timeout_s: float) -> redis.Redis:
    """A redis-py client for `url` (hiredis reply parser when installed) that does not retry on its own.

    Commands are packed by redis-py's Python packer, which sends arguments over 6 kB as separate buffers
    without copying them. (redis-py picks hiredis' `pack_command` when hiredis is installed; it copies
    every argument into one string and gets slow past ~128 kB: 250 us for one 136 kB insert of eight
    8x256 groups, 400 us with the script's keys, where the Python packer takes 100 us.) The asyncio
    client already packs this way.
    """
    kwargs = _client_kwargs(socket_timeout_s)
    encode = Encoder("utf-8", "strict", decode_responses=False).encode  # redis-py's default encoder
    kwargs["command_packer"] = PythonRespSerializer(_PACK_CUTOFF_BYTES, encode)
    return redis.Redis.from_url(url, **kwargs)


def async_client(url: str, socket_timeout_s: float) -> aioredis.Redis:
    """The asyncio twin of `sync_client`."""
    return aioredis.Redis.from_url(url, **_client_kwargs(socket_timeout_s))


def _unavailable(e: redis.RedisError, what: str, attempts: int) -> StorageUnavailable:
    return StorageUnavailable(f"{what} failed after {attempts} attempt(s): {type(e).__name__}: {e}")


def is_oom(e: BaseException) -> bool:
    """Redis refused a write for its `maxmemory` (`-OOM ...`, also from inside a script)."""
    return isinstance(e, OutOfMemoryError) or (isinstance(e, redis.ResponseError) and "OOM " in str(e))


def _translate(
    e: redis.RedisError, what: str, attempts: int, full_on_oom: bool
) -> BufferFull | StorageUnavailable:
    if full_on_oom and is_oom(e):
        return BufferFull(f"{what} refused: Redis is at its maxmemory ({e})", retry_after_s=1.0)
    return _unavailable(e, what, attempts)


def read_maxmemory(client: redis.Redis) -> int:
    """Redis' `maxmemory` in bytes (0: none set, or INFO not allowed to this client)."""
    try:
        return int(client.info("memory").get("maxmemory", 0))
    except redis.ResponseError:  # INFO renamed or denied by an ACL: no bound known
        return 0


async def read_maxmemory_async(client: aioredis.Redis) -> int:
    """The asyncio twin of `read_maxmemory`."""
    try:
        return int((await client.info("memory")).get("maxmemory", 0))
    except redis.ResponseError:
        return 0


def call_sync(
    fn: Callable[[], T],
    timeout_s: float,
    what: str,
    on_retry: Callable[[], None],
    full_on_oom: bool = False,
) -> T:
    """Run `fn`, retrying connection errors for `timeout_s` seconds; translate Redis errors (with
    `full_on_oom`, an out-of-memory refusal raises `BufferFull`)."""
    backoff = Backoff(timeout_s, _RETRY_INITIAL_S, _RETRY_MAX_S)
    while True:
        try:
            return fn()
        except _RETRYABLE as e:
            delay = backoff.delay()
            if delay is None:
                raise _unavailable(e, what, backoff.waits + 1) from e
            on_retry()
            time.sleep(delay)
        except redis.RedisError as e:
            raise _translate(e, what, backoff.waits + 1, full_on_oom) from e


async def call_async(
    fn: Callable[[], Awaitable[T]],
    timeout_s: float,
    what: str,
    on_retry: Callable[[], None],
    full_on_oom: bool = False,
) -> T:
    """The asyncio twin of `call_sync`."""
    backoff = Backoff(timeout_s, _RETRY_INITIAL_S, _RETRY_MAX_S)
    while True:
        try:
            return await fn()
        except _RETRYABLE as e:
            delay = backoff.delay()
            if delay is None:
                raise _unavailable(e, what, backoff.waits + 1) from e
            on_retry()
            await asyncio.sleep(delay)
        except redis.RedisError as e:
            raise _translate(e, what, backoff.waits + 1, full_on_oom) from e


# --- the insert and sample transactions


def _queue_insert(
    pipe,
    script: Script,
    cfg: BufferConfig,
    keys: BufferKeys,
    entries: list,
    max_bytes: int,
    table: bool,
    images: Mapping[str, bytes],
) -> None:
    """Queue the insert transaction on `pipe` (MULTI): each payload SET NX to its payload key (a stored
    group's payload is never overwritten), each image of `images` (sha256 -> bytes) SET NX to its key (a
    stored image is sent again, never written twice), then insert.lua with the metadata; with `table`,
    first a GET of the learner's table config (`keys.table`), in the same round trip."""
    if table:
        pipe.get(keys.table)
    for gid, _, _, payload, _ in entries:
        pipe.set(keys.payload(gid), payload, nx=True)
    for sha, data in images.items():
        pipe.set(keys.image(sha), data, nx=True)
    index_keys = keys.indexes()
    args = insert_args(cfg, keys, entries, max_bytes, " ".join(images))
    pipe.evalsha(script.sha, len(index_keys), *index_keys, *args)


def _transaction(
    client: redis.Redis, script: Script, queue: Callable[[Any], None], at_maxmemory: bool = False
) -> list:
    """Run the MULTI/EXEC that `queue` fills in (it holds one EVALSHA of `script`); return EXEC's replies.
    After a restart flushed the script cache, EVALSHA answers NOSCRIPT inside the transaction while the
    other commands ran: load the script and run the whole transaction once more. With `at_maxmemory`
    (the sample: it frees memory), a transaction Redis refused for its maxmemory (past it, Redis queues
    nothing in a MULTI) is sent again as a plain pipeline: see `_plain_after_oom`."""
    transaction, loaded = True, False
    while True:
        pipe = client.pipeline(transaction=transaction)
        queue(pipe)
        try:
            return pipe.execute()
        except NoScriptError:
            if loaded:
                raise
            loaded = True
            client.script_load(script.script)
        except redis.RedisError as e:
            if not _plain_after_oom(e, at_maxmemory and transaction):
                raise
            transaction = False


def _plain_after_oom(e: redis.RedisError, allowed: bool) -> bool:
    """Whether to resend a refused sample transaction as a plain pipeline (same commands, one round trip,
    in order): the script writes before it grows memory, so Redis runs it at maxmemory, and the MGET and
    UNLINK of its out keys never grow memory. The out keys are this call's alone, so what other clients
    run in between changes nothing; only a client that dies mid-send could leave its copies behind."""
    return allowed and is_oom(e)


def read_snapshot(client: redis.Redis, queue: Callable[[Any], None]) -> list:
    """Run the reads `queue` fills in as one MULTI/EXEC (a consistent snapshot); return their replies.
    Past maxmemory Redis queues nothing in a MULTI, reads included, so a transaction it refused for its
    maxmemory is sent again as a plain pipeline (one round trip, in order; reads never grow memory): the
    stats and priorities a learner reads while producers hold Redis at its limit."""
    try:
        pipe = client.pipeline(transaction=True)
        queue(pipe)
        return pipe.execute()
    except redis.RedisError as e:
        if not is_oom(e):
            raise
    pipe = client.pipeline(transaction=False)
    queue(pipe)
    return pipe.execute()


async def read_snapshot_async(client: aioredis.Redis, queue: Callable[[Any], None]) -> list:
    """The asyncio twin of `read_snapshot`."""
    try:
        pipe = client.pipeline(transaction=True)
        queue(pipe)
        return await pipe.execute()
    except redis.RedisError as e:
        if not is_oom(e):
            raise
    pipe = client.pipeline(transaction=False)
    queue(pipe)
    return await pipe.execute()


async def _transaction_async(
    client: aioredis.Redis, script: AsyncScript, queue: Callable[[Any], None], at_maxmemory: bool = False
) -> list:
    """The asyncio twin of `_transaction`."""
    transaction, loaded = True, False
    while True:
        pipe = client.pipeline(transaction=transaction)
        queue(pipe)
        try:
            return await pipe.execute()
        except NoScriptError:
            if loaded:
                raise
            loaded = True
            await client.script_load(script.script)
        except redis.RedisError as e:
            if not _plain_after_oom(e, at_maxmemory and transaction):
                raise
            transaction = False


def insert_transaction(
    client: redis.Redis,
    script: Script,
    cfg: BufferConfig,
    keys: BufferKeys,
    entries: list,
    max_bytes: int = 0,
    table: bool = False,
    images: Mapping[str, bytes] = MappingProxyType({}),
) -> tuple[list, bytes | None]:
    """Run one insert as MULTI / SET NX... / EVALSHA insert / EXEC (one round trip, one AOF entry,
    atomic: no other command runs in between); return the script's raw reply and, with `table`, the
    learner's table config (None: not read, or none published). A rerun after NOSCRIPT finds the keys the
    first run's SETs left (NX: unchanged) and this time indexes or deletes them."""
    queue = lambda pipe: _queue_insert(pipe, script, cfg, keys, entries, max_bytes, table, images)  # noqa: E731
    replies = _transaction(client, script, queue)
    return replies[-1], replies[0] if table else None


async def insert_transaction_async(
    client: aioredis.Redis,
    script: AsyncScript,
    cfg: BufferConfig,
    keys: BufferKeys,
    entries: list,
    max_bytes: int = 0,
    table: bool = False,
    images: Mapping[str, bytes] = MappingProxyType({}),
) -> tuple[list, bytes | None]:
    """The asyncio twin of `insert_transaction`."""
    queue = lambda pipe: _queue_insert(pipe, script, cfg, keys, entries, max_bytes, table, images)  # noqa: E731
    replies = await _transaction_async(client, script, queue)
    return replies[-1], replies[0] if table else None


def _queue_sample(
    pipe, script: Script, cfg: BufferConfig, keys: BufferKeys, k: int, version: int, lease: LeaseArgs | None
) -> None:
    """Queue the sample transaction on `pipe` (MULTI): sample.lua puts the i-th chosen payload at the
    call's out key i, then one MGET reads the k out keys and one UNLINK deletes them."""
    out = keys.out(secrets.token_hex(8))  # unique to this call: concurrent samples never share out keys
    slots = [f"{out}{i}" for i in range(1, k + 1)]
    index_keys = keys.indexes()
    args = sample_args(cfg, keys, k, version, out, lease)
    pipe.evalsha(script.sha, len(index_keys), *index_keys, *args)
    pipe.mget(slots)
    pipe.unlink(*slots)


def sample_transaction(
    client: redis.Redis,
    script: Script,
    cfg: BufferConfig,
    keys: BufferKeys,
    k: int,
    version: int,
    lease: LeaseArgs | None = None,
) -> SampleReply:
    """Run one sample as MULTI / EVALSHA sample / MGET out keys / UNLINK out keys / EXEC: one round
    trip, atomic, no payload left behind (after NOSCRIPT the MGET and UNLINK found nothing). With Redis
    past its maxmemory the same commands go as a plain pipeline, so the learner still drains."""
    queue = lambda pipe: _queue_sample(pipe, script, cfg, keys, k, version, lease)  # noqa: E731
    raw, payloads, _ = _transaction(client, script, queue, at_maxmemory=True)
    return SampleReply.parse(raw, payloads, lease is not None)


async def sample_transaction_async(
    client: aioredis.Redis,
    script: AsyncScript,
    cfg: BufferConfig,
    keys: BufferKeys,
    k: int,
    version: int,
    lease: LeaseArgs | None = None,
) -> SampleReply:
    """The asyncio twin of `sample_transaction`."""
    queue = lambda pipe: _queue_sample(pipe, script, cfg, keys, k, version, lease)  # noqa: E731
    raw, payloads, _ = await _transaction_async(client, script, queue, at_maxmemory=True)
    return SampleReply.parse(raw, payloads, lease is not None)
