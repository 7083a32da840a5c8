"""What the tests of the actor on real vLLM share: its config on the tiny model and the toy dataset,
running an actor in a thread, draining the buffer, and the learner's own log-probs of what was pushed
(the fixtures `engine`, `original_engine` and `dataset` are in conftest.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from offpolicy.actors.config import (
    ActorConfig,
    DatasetConfig,
    EngineConfig,
    ReloadConfig,
    RetryConfig,
    SamplingConfig,
)
from offpolicy.actors.rollout.actor import Actor
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.model import load_model
from offpolicy.learner.model.policy import token_logprobs

TEMPERATURE = 0.7
NUM_PROMPTS = 12


def actor_config(model_dir, dataset_path, redis_url, run_id, **over) -> ActorConfig:
    base = {
        "redis_url": redis_url,
        "run_id": run_id,
        "model_path": str(model_dir),
        "engine": EngineConfig.cpu_tiny(max_model_len=256),
        "sampling": SamplingConfig(temperature=TEMPERATURE, max_tokens=16, n=2),
        "dataset": DatasetConfig(path=str(dataset_path), chat_template=False),
        "reward": {"name": "target_token_share"},
        "reload": ReloadConfig(poll_interval_s=0.2),
        "retry": RetryConfig(initial_s=0.1, max_s=0.5),
    }
    return ActorConfig.model_validate(base | over)


def learner_logprobs(model_path: str | Path, groups: list[TrajectoryGroup], temperature: float | None = None):
    """(learner log-probs, behaviour log-probs, mask) with the learner's own collate + token_logprobs."""
    batch = collate(groups, pad_token_id=0)
    if temperature is not None:
        batch.temperatures = torch.full_like(batch.temperatures, temperature)
    model = load_model(model_path, device="cpu").eval()
    with torch.no_grad():
        lp = token_logprobs(model, batch)  # (B, R)
    return lp, batch.behavior_logprobs, batch.response_mask


def drain(redis_url: str, run_id: str, consumer_version: int) -> list[TrajectoryGroup]:
    with ReplayBuffer(redis_url, run_id) as buf:
        n = buf.stats().size
        return buf.sample(n, consumer_version=consumer_version, timeout_s=5.0) if n else []


def run_in_thread(actor: Actor) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    stop, errors = threading.Event(), []

    def main():
        try:
            actor.run(stop)
        except BaseException as e:  # handed to the test thread, which fails with it
            errors.append(e)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, stop, errors


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)
