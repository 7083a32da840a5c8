"""The file path with prefetch on real vLLM (CPU, tiny float32 model) and real embedded Redis.

The learner publishes under its mount of the weights volume with `publish.weights_root` (the record names
the folder relative to it); the actor sees the volume at another path (`reload.weights_root`), reads and
hashes the new version into memory while it keeps generating (`prefetch: memory`, `verify: full`), and
pauses the engine only to load the staged copy. Versions stay exact: every token's recorded version is
the one whose weights sampled it, checked with the learner's own log-probs.
"""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import ReloadConfig, SamplingConfig
from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.actors.rollout.actor import Actor
from offpolicy.learner.batch import collate
from offpolicy.learner.model import load_model
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.weights.record import PolicyStore
from tests.integration.actors.actor_run import (
    TEMPERATURE,
    actor_config,
    drain,
    learner_logprobs,
    run_in_thread,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]


def test_a_prefetched_version_under_another_mount_loads_with_exact_versions(
    engine, model_dir, redis_url, run_id, tmp_path
):
    dataset = write_target_token_dataset(tmp_path / "toy.jsonl", 12)
    learner_mnt, actor_mnt, shm = tmp_path / "learner-mnt", tmp_path / "actor-mnt", tmp_path / "shm"
    learner_mnt.mkdir()
    actor_mnt.symlink_to(learner_mnt)  # one volume, two mount points
    start = engine.loaded_version
    reload = ReloadConfig(
        poll_interval_s=0.2, mode="inflight", verify="full", prefetch="memory", prefetch_dir=str(shm),
        weights_root=str(actor_mnt),
    )  # fmt: skip
    cfg = actor_config(
        model_dir, dataset, redis_url, run_id,
        sampling=SamplingConfig(temperature=TEMPERATURE, max_tokens=96, n=2), reload=reload,
    )  # fmt: skip
    actor = Actor(cfg, CollectorRegistry(), engine=engine)
    thread, stop, errors = run_in_thread(actor)
    try:
        wait_until(lambda: actor.groups_pushed >= 4 or errors, 120, "groups from the starting weights")
        model = load_model(model_dir, device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        new = start + 3
        store = PolicyStore(redis_url, run_id)
        t0 = time.monotonic()
        record = publish_weights(
            model, learner_mnt / "run" / "weights", new, store=store, weights_root=learner_mnt
        )
        store.close()
        assert record.weights_uri == f"run/weights/v{new}"
        wait_until(lambda: engine.loaded_version == new or errors, 120, "the reload")
        took = time.monotonic() - t0
        pushed = actor.groups_pushed
        wait_until(lambda: actor.groups_pushed >= pushed + 8 or errors, 120, "groups after it")
    finally:
        stop.set()
        thread.join(60)
    assert not errors and not thread.is_alive()
    # loaded from the staged copy, remembered as the actor's path of the published folder, copy deleted
    assert engine.loaded_path == str(actor_mnt / "run" / "weights" / f"v{new}")
    assert not shm.exists() or list(shm.iterdir()) == []
    reg = actor.registry
    folder = learner_mnt / "run" / "weights" / f"v{new}"
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert reg.get_sample_value("offpolicy_actor_reload_prefetched_bytes_total", {"where": "memory"}) == size
    prefetch_s = reg.get_sample_value("offpolicy_actor_reload_prefetch_seconds_sum")
    pause_s = reg.get_sample_value("offpolicy_actor_reload_seconds_sum")
    assert reg.get_sample_value("offpolicy_actor_reload_seconds_count") == 1
    assert prefetch_s > 0 and 0 < pause_s < took  # both measured; the pause is one part of the update
    print(f"prefetch {prefetch_s:.3f} s before the pause, engine paused {pause_s:.3f} s, update {took:.2f} s")
    # versions exact: each token's log-prob under the version recorded for it is the behaviour log-prob
    groups = drain(redis_url, run_id, new)
    batch = collate(groups, pad_token_id=0)
    assert {int(v) for v in batch.versions[batch.response_mask > 0]} == {start, new}
    for version, weights in {start: model_dir, new: folder}.items():
        lp, behaviour, mask = learner_logprobs(weights, groups)
        mine = mask * (batch.versions == version)
        assert mine.sum() >= 20, f"too few tokens of v{version}"
        assert float(((lp - behaviour).abs() * mine).max()) < 1e-4
