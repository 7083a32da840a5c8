"""A LoRA learner's adapters served by an actor with `engine.lora` (real vLLM on CPU, real Redis): the
learner's publish path (`Persistence.publish`, as the trainer calls it) writes each version as an adapter
folder with a policy record of kind `lora`; the actor registers each one with its engine while it
generates, without reloading the base model, and every pushed token carries its request's adapter version:
its behaviour log-prob is the learner's log-prob under that version's adapter (version 0, before the
first adapter, is the base model exactly). An adapter evicted from vLLM's cache after the learner pruned
its folder is read again from the engine's own copy."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import EngineConfig, LoraEngineConfig
from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.actors.rollout.actor import Actor
from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.lora import LoraConfig
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import load_model, lora, make_tiny_model
from offpolicy.learner.model.policy import token_logprobs
from offpolicy.learner.persist.durable_writes import Persistence
from offpolicy.weights.record import PolicyStore
from tests.integration.actors.actor_run import actor_config, drain, run_in_thread, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

LORA = LoraConfig(rank=8, alpha=16.0)  # every linear layer of the decoder (all-linear)


def _perturb_adapter(model: torch.nn.Module, seed: int) -> None:
    """Move every B factor (and A) by a seeded step: the adapter is no longer the base (B = 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter_name(name):
                p.add_((0.3 if ".lora_B." in name else 0.05) * torch.randn(p.shape, generator=g))


def _versions_seen(groups: list) -> set[int]:
    return {
        int(v)
        for g in groups
        for t in g.trajectories
        for v in (t.versions if t.versions is not None else [g.policy_version])
    }


def test_actor_serves_each_published_adapter_with_exact_versions_and_never_reloads_the_base(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny")
    dataset = write_target_token_dataset(tmp_path / "toy.jsonl", 12)
    policies = {0: load_model(model_dir, "cpu").eval()}  # version 0: the base model
    model = lora.inject(load_model(model_dir, "cpu"), LORA, seed=0).eval()
    config = LearnerConfig.model_validate(
        {
            "model_path": str(model_dir),
            "lora": LORA.model_dump(),
            "publish": {"weights_dir": str(tmp_path / "w")},
        }
    )
    store = PolicyStore(redis_url, run_id)
    persist = Persistence(config, model, None, torch.float32, store, LearnerMetrics(CollectorRegistry()))

    def publish(version: int) -> None:  # an optimizer step's change, then the trainer's publish path
        _perturb_adapter(model, version)
        policies[version] = copy.deepcopy(model)
        persist.publish(version)
        persist.flush()
        record = store.read()
        assert record is not None and (record.version, record.kind) == (version, "lora")

    publish(1)
    cfg = actor_config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        engine=EngineConfig.cpu_tiny(max_model_len=256, lora=LoraEngineConfig(max_rank=8)),
        dataset={"path": str(dataset), "chat_template": False},  # epochs without end
    )
    registry = CollectorRegistry()
    actor = Actor(cfg, registry)  # the base model, once
    thread, stop, errors = run_in_thread(actor)
    groups: list = []

    def seen(version: int):
        def check() -> bool:
            groups.extend(drain(redis_url, run_id, version))
            return version in _versions_seen(groups)

        return check

    try:
        wait_until(seen(1), 180, "groups generated with adapter v1")
        publish(2)
        wait_until(seen(2), 180, "groups generated with adapter v2")
        wait_until(
            lambda: actor.engine.adapters.status()["adapters_loaded"] == [2], 60, "adapter v1 to be removed"
        )
        # vLLM reads an adapter again whenever a request needs it and it is not in vLLM's cache (evicted):
        # from the engine's own copy, so that the learner's pruning of its version folders cannot take it
        # away (before, the worker failed the step on the missing folder and the engine died)
        newest = actor.engine.adapters.newest
        assert newest.source and Path(newest.request.lora_path).parent == actor.engine.lora.files
        shutil.rmtree(newest.source)  # the learner pruned v2's folder
        actor.engine.call(actor.engine.lora.llm.remove_lora(newest.lora_id), 60)  # evicted behind our back
        evicted_at = len(groups)
        wait_until(
            lambda: bool(errors) or (seen(2)() and 2 in _versions_seen(groups[evicted_at:])),
            180,
            "v2's groups after its eviction",
        )
        status = actor.status()
    finally:
        stop.set()
        thread.join(60)
        actor.close()
        persist.close()
        store.close()
    assert not errors, errors
    groups += drain(redis_url, run_id, 2)
    assert actor.engine.base_loads == 0, "the base model is never reloaded"
    assert registry.get_sample_value("offpolicy_actor_adapter_loads_total") == 2
    assert registry.get_sample_value("offpolicy_actor_reload_failures_total", {"reason": "kind"}) == 0
    assert (
        status["policy_kind"] == "lora" and status["adapter_version"] == status["loaded_policy_version"] == 2
    )
    assert status["adapters_loaded"] == [2]
    checked: dict[int, int] = {0: 0, 1: 0, 2: 0}
    teeth = {1: 0.0, 2: 0.0}  # per version: the largest gap to the log-prob under the version before
    for g in groups:
        batch = collate([g], pad_token_id=0)
        with torch.no_grad():
            lps = {v: token_logprobs(m, batch) for v, m in policies.items()}  # (n, R) per version
        for i, t in enumerate(g.trajectories):
            versions = (
                t.versions if t.versions is not None else np.full(len(t.response_ids), g.policy_version)
            )
            assert len(set(versions.tolist())) == 1, "a request's tokens all come from its one adapter"
            for j, v in enumerate(versions.tolist()):
                behaviour = float(t.behavior_logprobs[j])
                assert abs(float(lps[v][i, j]) - behaviour) <= 1e-4, (v, i, j)
                if v >= 1:
                    teeth[v] = max(teeth[v], abs(float(lps[v - 1][i, j]) - behaviour))
                checked[v] += 1
    assert checked[1] > 30 and checked[2] > 30, checked
    assert teeth[1] > 1e-3, "v1's tokens under the base model must differ (the check has teeth)"
    assert teeth[2] > 1e-3, "v2's tokens under v1's adapter must differ"
