"""Rewards off the engine's event loop: sync functions on worker threads (the loop keeps running), async
ones awaited, per completion or batched, the prompt passed to `sample` functions, a timeout; and a remote
verifier over HTTP with bounded retries, a concurrency limit and a token from the environment."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

from offpolicy.actors.config import RewardConfig
from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.scoring import RewardSample, Scorer

PROMPT = Prompt(index=0, prompt_id="p0", text="2+2=", answer="4", metadata={"k": "v"})
COMPLETIONS = ["4", "5", "44", "four"]


# reward functions the config names by dotted path (tests.unit.actors.rollout.test_scoring.<name>)
def slow_exact(completion, answer, metadata):
    time.sleep(0.3)
    return float(completion == answer)


async def async_length(completion, answer, metadata):
    await asyncio.sleep(0.01)
    return float(len(completion))


def batched_rank(completions, answer, metadata):
    return [float(i) for i in range(len(completions))]


def sample_prompt_length(sample: RewardSample) -> float:
    return float(len(sample.prompt) + len(sample.completion))


def never_finite(completion, answer, metadata):
    return float("nan")


def too_few(completions, answer, metadata):
    return [1.0]


def hangs(completion, answer, metadata):
    time.sleep(2.0)
    return 1.0


def run(scorer: Scorer, completions=COMPLETIONS) -> list[float]:
    return asyncio.run(scorer.score(PROMPT, completions))


def test_a_slow_sync_reward_runs_on_threads_while_the_loop_goes_on():
    scorer = Scorer(RewardConfig(name="tests.unit.actors.rollout.test_scoring.slow_exact", workers=4))

    async def main() -> tuple[list[float], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        rewards = await scorer.score(PROMPT, COMPLETIONS)  # 4 x 0.3 s of blocking calls
        task.cancel()
        return rewards, ticks

    rewards, ticks = asyncio.run(main())
    scorer.close()
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert ticks >= 5  # the loop kept turning while the reward slept (a blocking call would allow none)


def test_async_batched_and_sample_rewards():
    assert run(Scorer(RewardConfig(name="tests.unit.actors.rollout.test_scoring.async_length"))) == [
        1.0,
        1.0,
        2.0,
        4.0,
    ]
    batched = RewardConfig(name="tests.unit.actors.rollout.test_scoring.batched_rank", batched=True)
    assert run(Scorer(batched)) == [0.0, 1.0, 2.0, 3.0]
    sample = RewardConfig(
        name="tests.unit.actors.rollout.test_scoring.sample_prompt_length", signature="sample"
    )
    assert run(Scorer(sample)) == [5.0, 5.0, 6.0, 8.0]  # len("2+2=") + len(completion)


@pytest.mark.parametrize(
    ("name", "extra", "match"),
    [
        ("never_finite", {}, "not a finite number"),
        ("too_few", {"batched": True}, "1 rewards for 4 completions"),
        ("hangs", {"timeout_s": 0.2}, "no reward within 0.2 s"),
    ],
)
def test_a_failing_reward_is_a_reward_error(name, extra, match):
    scorer = Scorer(RewardConfig(name=f"tests.unit.actors.rollout.test_scoring.{name}", **extra))
    with pytest.raises(RewardError, match=match):
        run(scorer)
    scorer.close()


def test_the_config_pairs_remote_with_its_verifier():
    with pytest.raises(ValidationError, match="remote"):
        RewardConfig(name="remote")
    with pytest.raises(ValidationError, match="length_penalty"):
        RewardConfig(name="exact_match", batched=True, length_penalty=0.1)
    with pytest.raises(ValidationError):
        RewardConfig(name="remote", remote={"url": "ftp://x"})


# --- the remote verifier


class Verifier(BaseHTTPRequestHandler):
    """Rewards = completion lengths; the first request of a server fails with 500; counts concurrency."""

    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.seen.append((body, self.headers.get("Authorization")))
            server.active += 1
            server.peak = max(server.peak, server.active)
            fail = len(server.seen) == 1
        time.sleep(server.delay_s)
        with server.lock:
            server.active -= 1
        if fail:
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def verifier():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Verifier)
    server.lock, server.seen, server.active, server.peak, server.delay_s = threading.Lock(), [], 0, 0, 0.1
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_remote_reward_retries_limits_concurrency_and_sends_the_token(verifier, monkeypatch):
    monkeypatch.setenv("VERIFIER_TOKEN", "s3cret")
    url = f"http://127.0.0.1:{verifier.server_address[1]}/score"
    cfg = RewardConfig(
        name="remote", remote={"url": url, "concurrency": 2, "retries": 2, "token_env": "VERIFIER_TOKEN"}
    )
    scorer = Scorer(cfg)

    async def main() -> list[list[float]]:
        out = await asyncio.gather(*(scorer.score(PROMPT, COMPLETIONS) for _ in range(6)))
        await scorer.aclose()
        return out

    results = asyncio.run(main())
    assert results == [[1.0, 1.0, 2.0, 4.0]] * 6  # the first request's 500 was retried
    assert len(verifier.seen) == 7 and verifier.peak <= 2
    body, auth = verifier.seen[0]
    assert auth == "Bearer s3cret"
    assert body == {
        "prompt_id": "p0",
        "prompt": "2+2=",
        "completions": COMPLETIONS,
        "answer": "4",
        "metadata": {"k": "v"},
    }


def test_an_unreachable_verifier_fails_the_group_after_its_retries():
    cfg = RewardConfig(
        name="remote", remote={"url": "http://127.0.0.1:9/score", "retries": 1, "timeout_s": 1}
    )
    scorer = Scorer(cfg)
    with pytest.raises(RewardError, match="after 2 attempt"):
        run(scorer)
