"""An agent written outside the actor, trained through the OpenAI-compatible gateway: the guessing game
(three policy turns of 6 tokens, the user answering `warmer` / `colder` between them; reward = the share
of the secret character in the policy's text) played by an HTTP client against the actor service's
gateway, while the learner service trains on the recorded episodes (the quickstart's tiny model and
learner config; both services as child processes, embedded Redis).

Two phases on one actor service:
1. exactness, before the learner starts: two groups of episodes; their records are read back from the
   buffer and compared with what the client received: `tokens_exact` is true when every recorded policy
   token and behaviour log-prob is exactly a call's output (token ids and log-probs the gateway returned),
   in order, and every environment token is the chat template's rendering of the client's messages;
2. learning: `--concurrency` episodes at a time until the learner has made `--steps` steps.
   `reward_first` / `reward_last`: mean reward of the first / last `--concurrency` episodes;
   `episodes_per_s`: episodes finished per second; `gateway_overhead_share`: the time chat calls spend in
   the gateway's own code (the route handler's time minus the engine's generation within it, from the
   actor's `offpolicy_actor_gateway_seconds_total`) over the episodes' wall time (target <= 0.05).

    python benchmarks/agent.py [--steps 10] [--concurrency 16] [--json] [--smoke]

`--smoke`: both phases with 1 learner step and 4 episodes in flight (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.actors.engine.chat import render_messages
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import build_char_tokenizer, make_tiny_model
from offpolicy.services.children import start_service
from offpolicy.services.quickstart.configs import actor_config, learner_config

TURNS, TURN_TOKENS, GROUP = 3, 6, 4
RUN_ID = "bench-agent"
SMOKE = {"steps": 1, "concurrency": 4}
"""`--smoke`'s defaults (flags given explicitly still win)."""


async def play(http: httpx.AsyncClient, prompt: dict[str, Any]) -> dict[str, Any]:
    """One guessing-game episode through the gateway; what the client saw."""
    t0 = time.perf_counter()
    opened = (await http.post("/v1/episodes", json={"prompt_id": prompt["id"], "group_size": GROUP})).json()
    eid, target = opened["episode_id"], prompt["answer"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt["prompt"]}]
    turns, said, hits, last = [], 0, 0, -1
    for turn in range(TURNS):
        body = {"model": "offpolicy", "messages": messages, "max_tokens": TURN_TOKENS, "logprobs": True}
        r = await http.post("/v1/chat/completions", json=body, headers={"X-Episode-Id": eid})
        if r.status_code == 409:  # the episode's budget is spent
            break
        r.raise_for_status()
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] or ""
        turns.append((choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]))
        messages.append({"role": "assistant", "content": text})
        count = text.count(target)
        said, hits = said + len(text), hits + count
        if turn < TURNS - 1:
            messages.append({"role": "user", "content": "warmer" if count > last else "colder"})
        last = count
    reward = hits / said if said else 0.0
    done = await http.post(f"/v1/episodes/{eid}/finish", json={"reward": reward})
    done.raise_for_status()
    return {
        "group_id": opened["group_id"],
        "messages": messages,
        "turns": turns,
        "reward": reward,
        "wall_s": time.perf_counter() - t0,
        "finished_at": time.time(),
    }


def exact(records: list[dict[str, Any]], groups: list[Any]) -> bool:
    """Every recorded trajectory is one client episode's calls, token for token (see the docstring)."""
    tok = build_char_tokenizer()
    by_group: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_group.setdefault(rec["group_id"], []).append(rec)
    if len(groups) != len(by_group):
        return False
    for group in groups:
        candidates = by_group.get(group.metadata.get("gateway_group_id", ""), [])
        for t in group.trajectories:
            mask = t.policy_mask if t.policy_mask is not None else np.ones(len(t.response_ids), bool)
            found = False
            for rec in candidates:
                ids, lps, policy = [], [], []
                user_turns = [m for m in rec["messages"][1:] if m["role"] == "user"]
                for i, (turn_ids, turn_lps) in enumerate(rec["turns"]):
                    ids += turn_ids
                    lps += turn_lps
                    policy += [True] * len(turn_ids)
                    if i < len(user_turns):
                        env = render_messages(tok, [user_turns[i]])
                        ids += env
                        lps += [0.0] * len(env)
                        policy += [False] * len(env)
                if t.response_ids.tolist() == ids and mask.tolist() == policy:
                    found = bool(np.array_equal(t.behavior_logprobs.astype(np.float32), np.float32(lps)))
                    break
            if not found:
                return False
    return True


async def drive(url: str, prompts: list[dict[str, Any]], stop: Any, concurrency: int) -> list[dict[str, Any]]:
    """`concurrency` episodes at a time over `prompts` (each prompt GROUP times, one group) until `stop()`."""
    out: list[dict[str, Any]] = []
    queue = [p for p in prompts for _ in range(GROUP)]
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def worker(k: int) -> None:
            i = k
            while not stop():
                out.append(await play(http, queue[i % len(queue)]))
                i += concurrency

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return out


def gateway_seconds(url: str) -> dict[str, float]:
    """{part: seconds} of the actor's `offpolicy_actor_gateway_seconds_total` (whatever other labels the
    samples carry, such as the run's `run_id`)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.labels["part"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "offpolicy_actor_gateway_seconds_total"
    }


def run(root: Path, steps: int, concurrency: int) -> dict[str, Any]:
    model = str(make_tiny_model(root / "model"))
    dataset = write_target_token_dataset(root / "dataset.jsonl")
    prompts = [json.loads(line) for line in dataset.read_text().splitlines()]
    with EmbeddedRedis.start(root / "redis") as redis:
        actor_cfg = actor_config(model, dataset, redis.url, RUN_ID)
        actor_cfg["dataset"] = None
        actor_cfg["gateway"] = {"enabled": True, "group_size": GROUP}
        actor_cfg["sampling"]["max_tokens"] = 80  # 3 turns of 6 and two user turns, as the environment's
        (root / "actor.yaml").write_text(yaml.safe_dump(actor_cfg))
        (root / "learner.yaml").write_text(yaml.safe_dump(learner_config(root, model, redis.url, RUN_ID)))
        actor = start_service("actor", root / "actor.yaml", root / "actor.log")
        learner = None
        try:
            actor.wait_ready(300)
            # --- 1. exactness: two groups, read back from the buffer before anything trains on them
            first = asyncio.run(_two_groups(actor.url, prompts[:2]))
            with ReplayBuffer(redis.url, RUN_ID) as buf:
                deadline = time.monotonic() + 30
                while buf.stats().size < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                groups = buf.sample(buf.stats().size, consumer_version=0, timeout_s=5.0)
                tokens_exact = exact(first, groups)
                buf.clear()
            # --- 2. learning
            learner = start_service("learner", root / "learner.yaml", root / "learner.log")
            learner.wait_ready(180)
            steps_file = root / "learner_steps.jsonl"

            def enough() -> bool:
                return steps_file.exists() and len(steps_file.read_text().splitlines()) >= steps

            before, t0 = gateway_seconds(actor.url), time.perf_counter()
            episodes = asyncio.run(drive(actor.url, prompts[2:], enough, concurrency))
            wall, after = time.perf_counter() - t0, gateway_seconds(actor.url)
        finally:
            codes = [actor.stop()] + ([learner.stop()] if learner is not None else [])
    episodes.sort(key=lambda e: e["finished_at"])
    own = (after["request"] - before["request"]) - (after["engine"] - before["engine"])
    window = min(concurrency, len(episodes) // 2)
    return {
        "reward_first": float(np.mean([e["reward"] for e in first + episodes[:window]])),
        "reward_last": float(np.mean([e["reward"] for e in episodes[-window:]])),
        "episodes": len(episodes),
        "episodes_per_s": len(episodes) / wall,
        "gateway_overhead_share": own / sum(e["wall_s"] for e in episodes),
        "gateway_own_s_per_call": own / max(1, sum(len(e["turns"]) for e in episodes)),
        "tokens_exact": tokens_exact,
        "learner_steps": steps,
        "concurrency": concurrency,
        "wall_s": wall,
        "exit_codes": codes,
        "load_avg_1m": os.getloadavg()[0],
    }


async def _two_groups(url: str, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return list(await asyncio.gather(*(play(http, p) for p in prompts for _ in range(GROUP))))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="learner steps in the learning phase")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight at once")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--smoke", action="store_true", help="1 learner step, 4 episodes in flight (CI)")
    args = parser.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="offpolicy-agent-") as tmp:
        result = run(Path(tmp), args.steps, args.concurrency)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
