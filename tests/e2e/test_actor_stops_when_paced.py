"""An actor service (real vLLM on CPU) paced by a full buffer (no learner consumes: `max_ahead` groups and
it waits, `retry.pacing_timeout_s` 25 s) exits within 5 s of SIGTERM, its engine included."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import yaml

from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.learner.model import make_tiny_model
from offpolicy.services.children import start_service
from offpolicy.services.quickstart.configs import actor_config

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.vllm]


def pacing_seconds(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    lines = [ln for ln in text.splitlines() if ln.startswith("offpolicy_actor_buffer_wait_seconds_total")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'reason="pacing"' in ln)


def test_a_paced_actor_exits_within_5_s_of_sigterm(tmp_path):
    from offpolicy.actors.data.toy import write_target_token_dataset

    model = str(make_tiny_model(tmp_path / "model"))
    dataset = write_target_token_dataset(tmp_path / "dataset.jsonl")
    with EmbeddedRedis.start(tmp_path / "redis") as redis:
        cfg = actor_config(model, dataset, redis.url, "paced")
        cfg["buffer"]["max_ahead"] = 2
        cfg["retry"]["pacing_timeout_s"] = 25.0
        (tmp_path / "actor.yaml").write_text(yaml.safe_dump(cfg))
        actor = start_service("actor", tmp_path / "actor.yaml", tmp_path / "actor.log")
        try:
            actor.wait_ready(timeout_s=300)
            deadline = time.monotonic() + 120
            while pacing_seconds(actor.url) < 2.0:  # inserted its groups, now waiting on the learner
                assert time.monotonic() < deadline, actor.log_tail()
                time.sleep(0.5)
            t0 = time.monotonic()
            actor.proc.send_signal(signal.SIGTERM)
            code = actor.proc.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            actor.stop()
    print(f"paced actor exited {code} {took:.2f} s after SIGTERM")
    assert code in (0, -signal.SIGTERM), actor.log_tail()
    assert took < 5.0, (took, actor.log_tail())
