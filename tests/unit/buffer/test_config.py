"""BufferConfig: presets, Reverb-style deadlock checks with values in the message, limiter bounds."""

from __future__ import annotations

import re

import pydantic
import pytest

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.keys import BufferKeys, PolicyKeys
from offpolicy.buffer.rate_limiter import Backoff, check_sample_size


def test_presets() -> None:
    q = BufferConfig.queue(max_size=7)
    assert (q.sampler, q.max_times_sampled, q.max_size) == ("fifo", 1, 7)
    u = BufferConfig.uniform_replay()
    assert (u.sampler, u.max_times_sampled) == ("uniform", None)
    s = BufferConfig.staleness_weighted(max_staleness=2, max_times_sampled=None)
    assert (s.sampler, s.max_staleness, s.max_times_sampled) == ("staleness_weighted", 2, None)


def test_frozen_and_extra_forbidden() -> None:
    with pytest.raises(pydantic.ValidationError):
        BufferConfig(max_sizee=3)
    with pytest.raises(pydantic.ValidationError):
        BufferConfig().max_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_size_to_sample": 5, "max_size": 4}, "min_size_to_sample=5 > max_size=4"),
        ({"samples_per_insert": 2.0}, "samples_per_insert=2.0 needs an error_buffer"),
        ({"error_buffer": 3.0}, "error_buffer=3.0 is set but samples_per_insert is None"),
        (
            {"samples_per_insert": 4.0, "error_buffer": 3.0, "max_times_sampled": None},
            "error_buffer=3.0 < max(1",
        ),
        (
            {"samples_per_insert": 0.5, "error_buffer": 0.5},
            "error_buffer=0.5 < max(1, samples_per_insert=0.5)",
        ),
        ({"samples_per_insert": 2.0, "error_buffer": 4.0}, "samples_per_insert=2.0 > max_times_sampled=1"),
    ],
)
def test_deadlocks_rejected_with_values(kwargs: dict, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
        BufferConfig(**kwargs)


def test_limiter_bounds_are_reverbs() -> None:
    cfg = BufferConfig(samples_per_insert=2.0, error_buffer=3.0, min_size_to_sample=5, max_times_sampled=None)
    assert cfg.limiter_bounds() == (7.0, 13.0)  # 2*5 -/+ 3
    assert BufferConfig().limiter_bounds() == (float("-inf"), float("inf"))


def test_sample_size_the_ratio_can_never_allow() -> None:
    check_sample_size(6, 7.0, 13.0)
    with pytest.raises(ValueError, match=r"num_groups=7 > 2 \* error_buffer = 6.0"):
        check_sample_size(7, 7.0, 13.0)


def test_backoff_doubles_to_cap_then_stops() -> None:
    b = Backoff(timeout_s=60.0, initial_s=0.01, max_s=0.04)
    assert [b.delay() for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]
    assert Backoff(timeout_s=0.0, initial_s=0.01, max_s=0.04).delay() is None


def test_keys_share_one_hash_tag() -> None:
    keys = BufferKeys.for_run("run-1")
    names = [
        *keys.indexes(), keys.payload("g1"), keys.out("t0"), keys.consumer_prefix + "learner-0",
        keys.image("ab"),
    ]  # fmt: skip
    assert all("{run-1}" in k for k in names) and len(set(names)) == 18
    assert keys.payload("g1") == "offpolicy:{run-1}:buf:g:g1"
    assert keys.image("ab") == "offpolicy:{run-1}:buf:img:ab"  # the bytes of image "ab", once per buffer
    assert PolicyKeys.for_run("run-1").record == "offpolicy:{run-1}:policy"
    with pytest.raises(ValueError, match="run_id"):
        BufferKeys.for_run("a}b")
