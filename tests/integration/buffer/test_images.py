"""Images in the buffer: each stored once as a content-addressed blob (sha256), named by the groups that
show it, counted in the byte budget once, kept while a group naming it is stored or leased, and deleted
with the last of them (acked, evicted, stale, dead-lettered); an insert naming an image that is neither
sent nor stored is refused alone. Real Redis 6.2 and 7."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import redis

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.errors import ImagesMissing, InvalidTrajectory
from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import AsyncReplayBuffer
from tests.conftest import build_group

pytestmark = pytest.mark.redis
FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}
C = "learner-0"


def image(seed: int, size: int = 50_000) -> tuple[str, bytes]:
    data = os.urandom(8) + bytes([seed % 256]) * size  # distinct per call: a fresh image
    return hashlib.sha256(data).hexdigest(), data


def showing(shas: list[str], n: int = 4, version: int = 0, seed: int = 0):
    return dataclasses.replace(build_group(version, n=n, seed=seed), images=list(shas))


def stored_images(raw: redis.Redis, keys: BufferKeys) -> set[str]:
    """The image keys in Redis (SCAN), as their sha256s."""
    return {k.decode().rsplit(":", 1)[1] for k in raw.scan_iter(match=keys.images + ":*", count=1000)}


def test_n_completions_of_one_image_store_it_once_until_the_last_group_naming_it_is_acked(env) -> None:
    make, raw, keys = env
    b = make(max_times_sampled=1)
    (a, da), (c, dc) = image(1), image(2)
    g1, g2 = showing([a], n=8), showing([a, c], seed=1)
    plain = build_group(0, n=8, seed=2)
    assert b.insert_many([g1, g2, plain], images={a: da, c: dc}).ok
    s = b.stats()
    assert (s.images, s.image_bytes) == (2, len(da) + len(dc))  # eight completions, two groups: a once
    assert stored_images(raw, keys) == {a, c}
    payloads = sum(raw.strlen(keys.payload(g.group_id)) for g in (g1, g2, plain))
    assert s.payload_bytes == payloads + len(da) + len(dc)

    leased = b.lease(3, 0, consumer=C, lease_s=60)
    by_id = {g.group_id: (g, lid) for g, lid in zip(leased.groups, leased.lease_ids, strict=True)}
    assert by_id[g2.group_id][0].images == [a, c]  # the record names them, in order
    assert b.images([a, c]) == {a: da, c: dc}
    b.ack(C, [by_id[g1.group_id][1], by_id[plain.group_id][1]])
    assert stored_images(raw, keys) == {a, c}  # g2 still names a
    assert b.stats().image_bytes == len(da) + len(dc)
    b.ack(C, [by_id[g2.group_id][1]])
    s = b.stats()
    assert (s.size, s.images, s.image_bytes, s.payload_bytes) == (0, 0, 0, 0)
    assert stored_images(raw, keys) == set()
    assert raw.hlen(keys.images) == 0 and raw.hlen(keys.group_images) == 0
    with pytest.raises(ImagesMissing, match="1 image"):
        b.images([a])


def test_an_insert_naming_an_image_neither_sent_nor_stored_is_refused_alone(env) -> None:
    make, raw, keys = env
    b = make()
    (a, da), (c, _), (d, dd) = image(1), image(2), image(3)
    ok, missing, plain = showing([a]), showing([c], seed=1), build_group(0, seed=2)
    wrong = showing([d], seed=3)
    result = b.insert_many([ok, missing, plain, wrong], images={a: da, d: dd + b"x"})
    assert result.rejected == {missing.group_id: "images", wrong.group_id: "images[0]"}
    assert set(result.inserted) == {ok.group_id, plain.group_id}
    assert stored_images(raw, keys) == {a}  # d's bytes were wrong: nothing of them stored
    assert raw.get(keys.payload(missing.group_id)) is None and raw.get(keys.payload(wrong.group_id)) is None
    assert b.stats().rejected_total == {"images": 2}  # the missing one (counted by the script), the wrong one
    # a later group names a stored image without sending it again: a reference, no bytes
    later = showing([a], seed=4)
    assert b.insert_many([later]).inserted == (later.group_id,)
    assert b.stats().image_bytes == len(da)
    # the same group again, image and all: a duplicate, counted nowhere twice
    assert b.insert_many([later], images={a: da}).duplicates == (later.group_id,)
    assert b.stats().image_bytes == len(da) and raw.hget(keys.images, a) == b"2"
    with pytest.raises(InvalidTrajectory, match=r"images\[1\]: must be a sha256"):
        b.insert(showing([a, "A" * 64]))


def test_images_leave_with_evicted_stale_and_dead_lettered_groups(env) -> None:
    make, raw, keys = env
    b = make(max_size=2, max_staleness=1, max_times_sampled=None)
    shown = [image(i) for i in range(3)]
    gs = [showing([sha], version=v, seed=v) for v, (sha, _) in enumerate(shown)]
    for g, (sha, data) in zip(gs, shown, strict=True):
        b.insert(g, images={sha: data})
    assert stored_images(raw, keys) == {shown[1][0], shown[2][0]}  # the oldest evicted past max_size
    b.lease(1, 3, consumer=C, lease_s=60)  # version 3: the group of version 1 is stale, dropped
    assert stored_images(raw, keys) == {shown[2][0]}
    (lid,) = b.leases(C)
    assert b.dead_letter(C, lid, "poison", "images")
    s = b.stats()
    assert stored_images(raw, keys) == set()
    assert (s.size, s.images, s.image_bytes, s.payload_bytes) == (0, 0, 0, 0)


def test_a_consumed_groups_image_stays_readable_for_its_sampler_and_out_of_the_budget(env) -> None:
    make, raw, keys = env
    b = make(max_times_sampled=1)
    sha, data = image(1)
    b.insert(showing([sha]), images={sha: data})
    (g,) = b.sample(1, 0)
    assert b.stats().image_bytes == 0 and b.stats().payload_bytes == 0  # the buffer holds nothing now
    assert b.images(g.images) == {sha: data}  # yet the sampler reads it: it expires a little later
    assert 0 < raw.pttl(keys.image(sha)) <= 60_000
    again = showing([sha], seed=1)  # shown again meanwhile: stored again, for good
    assert b.insert_many([again]).ok
    assert raw.pttl(keys.image(sha)) == -1 and b.stats().image_bytes == len(data)


def test_images_count_once_in_the_byte_budget(env) -> None:
    make = env[0]
    probe = make(max_bytes=0)
    sha, data = image(1, size=200_000)
    first = showing([sha])
    probe.insert(first, images={sha: data})
    one = probe.stats().payload_bytes
    probe.clear()
    b = make(max_bytes=one + 3 * (one - len(data)) + 100)  # one image, four group payloads
    gs = [showing([sha], seed=i) for i in range(4)]
    assert b.insert_many(gs, images={sha: data}).ok
    assert b.stats().image_bytes == len(data)


def test_a_learner_killed_mid_lease_leaves_the_image_for_the_next(env, any_redis, run_id) -> None:
    make, raw, keys = env
    b = make(max_times_sampled=1)
    sha, data = image(1)
    b.insert(showing([sha]), images={sha: data})
    child = textwrap.dedent(f"""
        import os, signal
        from offpolicy.buffer.config import BufferConfig
        from offpolicy.buffer.replay_buffer import ReplayBuffer
        b = ReplayBuffer({any_redis.url!r}, {run_id!r}, BufferConfig())
        leased = b.lease(1, 0, consumer="learner-9", lease_s=0.5)
        assert b.images(leased.groups[0].images)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    assert stored_images(raw, keys) == {sha}  # leased by a dead learner: kept
    leased = b.lease(1, 0, consumer=C, lease_s=60, timeout_s=10)  # its lease expired: the group came back
    assert b.images(leased.groups[0].images) == {sha: data}
    b.ack(C, leased.lease_ids)
    assert stored_images(raw, keys) == set() and b.stats().image_bytes == 0


def test_the_async_buffer_stores_and_reads_images(any_redis, run_id) -> None:
    sha, data = image(1)

    async def go() -> None:
        async with AsyncReplayBuffer(any_redis.url, run_id, BufferConfig(**FAST)) as b:
            try:
                assert (await b.insert_many([showing([sha]), showing([sha], seed=1)], images={sha: data})).ok
                assert (await b.stats()).images == 1
                assert await b.images([sha]) == {sha: data}
            finally:
                await b.clear()

    asyncio.run(go())
