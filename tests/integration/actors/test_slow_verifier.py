"""A slow remote verifier does not hold the engine back: while the verifier sleeps on a group, the engine
goes on generating at its full batch (`max_inflight_prompts` requests), the group's slot given to the next
prompt instead of being held until the group is scored.

Real vLLM on CPU (tiny model), an embedded Redis, `reward.name: remote` pointing at a verifier in this
process that sleeps `DELAY_S` per request and, while it sleeps, samples how many group requests the
engine is generating. A slot held until scoring ends would leave at most `SLOTS - 1` of them. The delay is
well below one group's generation time, so the actor's bound on groups being scored never binds. This
checks behaviour, not speed (`benchmarks/reward_latency.py` measures tokens/s with and without a 200 ms
verifier)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ActorConfig, EngineConfig, SamplingConfig
from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.actors.engine.vllm import VLLMEngine
from offpolicy.actors.rollout.actor import Actor
from offpolicy.buffer.embedded import EmbeddedRedis

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

SLOTS = 4  # max_inflight_prompts
TOKENS = 96  # every completion this long: a group takes far longer than DELAY_S to generate
DELAY_S = 0.1
RUN_S = 8.0


class CountingEngine:
    """The real engine, counting the group requests it is generating at each moment."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self.running = 0  # changed on the engine's loop, read by the verifier's threads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate_group(self, request_id: str, prompt_ids: Any, params: Any) -> Any:
        self.running += 1
        try:
            return await self._engine.generate_group(request_id, prompt_ids, params)
        finally:
            self.running -= 1


class SamplingVerifier(BaseHTTPRequestHandler):
    """Sleeps `DELAY_S` per request, sampling the engine's running requests every 10 ms; rewards 0."""

    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        end = time.monotonic() + DELAY_S
        while (now := time.monotonic()) < end:
            with server.lock:
                server.samples.append((now, server.engine.running))
            time.sleep(0.01)
        out = json.dumps({"rewards": [0.0] * len(body["completions"])}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the actor stopped and closed its client while this request slept

    def log_message(self, *args: Any) -> None:
        pass


def test_the_engine_stays_full_while_a_slow_verifier_scores(
    original_engine: VLLMEngine, model_dir: Path, tmp_path: Path
) -> None:
    model, engine = model_dir, original_engine  # the package's engine (tests/integration/actors/conftest.py)
    dataset = write_target_token_dataset(tmp_path / "toy.jsonl", 16)
    server = ThreadingHTTPServer(("127.0.0.1", 0), SamplingVerifier)
    server.daemon_threads = True
    server.lock, server.samples = threading.Lock(), []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    server.engine = CountingEngine(engine)
    params = engine.sampling_params(SamplingConfig(temperature=0.7, max_tokens=TOKENS, n=4), ignore_eos=True)

    class FixedLengthActor(Actor):
        def request_params(self, prompt: Prompt) -> Any:
            return params

    try:
        with EmbeddedRedis.start(tmp_path / "redis") as redis:
            config = ActorConfig(
                redis_url=redis.url,
                run_id="slow-verifier",
                model_path=str(model),
                engine=EngineConfig.cpu_tiny(max_model_len=256),
                sampling=SamplingConfig(temperature=0.7, max_tokens=TOKENS, n=4),
                dataset={"path": str(dataset)},
                reward={"name": "remote", "remote": {"url": url, "concurrency": 64, "timeout_s": 30}},
                max_inflight_prompts=SLOTS,
                reload={"enabled": False},
            )
            actor = FixedLengthActor(config, CollectorRegistry(), server.engine)
            stop = threading.Event()
            thread = threading.Thread(target=actor.run, args=(stop,), daemon=True)
            thread.start()
            time.sleep(RUN_S)
            stopped = time.monotonic()
            stop.set()
            thread.join(timeout=60)
            actor.close()
    finally:
        server.shutdown()
        server.server_close()
    assert not thread.is_alive()
    running = [n for t, n in server.samples if t < stopped]  # the engine's requests while a group slept
    assert actor.groups_pushed >= SLOTS and len(running) >= 20, (actor.groups_pushed, len(running))
    mean = statistics.fmean(running)
    print(f"group requests in the engine while the verifier slept: mean {mean:.2f} of {SLOTS}")
    assert mean > SLOTS - 0.5, running  # a slot held until scoring ends: at most SLOTS - 1
