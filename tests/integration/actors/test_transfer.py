"""The actor service's loop with `reload.transport: vllm` (real vLLM on CPU over the `gloo` engine, real
Redis): it builds its engine with the weight-transfer engine, starts from the base model, loads the newest
file generation before it announces itself, then receives a version by transfer while it generates; every
token pushed to the buffer carries the version its engine held, and its behaviour log-prob is the
learner's log-prob under that version's weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from offpolicy.actors.config import DatasetConfig, ReloadConfig
from offpolicy.actors.data.toy import write_target_token_dataset
from offpolicy.actors.rollout.actor import Actor
from offpolicy.learner.batch import collate
from offpolicy.learner.model import load_model, make_tiny_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.model.policy import token_logprobs
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.learner.transport.vllm import VllmTransport
from offpolicy.weights.config import TransferConfig
from offpolicy.weights.control import LearnerControl
from offpolicy.weights.record import PolicyStore
from tests.integration.actors.actor_run import actor_config, drain, run_in_thread, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow, pytest.mark.usefixtures("vllm_plugin")]

CFG = TransferConfig(backend="gloo", timeout_s=20.0, heartbeat_s=0.5, bucket_bytes=1 << 20)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in unique_state(model).values():
            if t.is_floating_point():
                t.add_(0.05 * torch.randn(t.shape, generator=g))


def test_actor_catches_up_from_files_then_receives_by_transfer_with_exact_versions(
    tmp_path, redis_url, run_id
):
    model_dir = make_tiny_model(tmp_path / "tiny")
    dataset = write_target_token_dataset(tmp_path / "toy.jsonl", 12)
    model = load_model(model_dir, "cpu").eval()
    policies = {0: copy.deepcopy(model)}
    store = PolicyStore(redis_url, run_id)
    _perturb(model, 1)
    policies[1] = copy.deepcopy(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    publish_weights(model, tmp_path / "weights", 1, tokenizer=tokenizer, store=store, dtype=torch.float32)
    cfg = actor_config(
        model_dir,
        dataset,
        redis_url,
        run_id,
        dataset=DatasetConfig(path=str(dataset), chat_template=False),  # epochs without end
        reload=ReloadConfig(poll_interval_s=0.2, transport="vllm", transfer=CFG),
    )
    registry = CollectorRegistry()
    actor = Actor(cfg, registry)  # builds its engine with the gloo weight-transfer engine
    control = LearnerControl(redis_url, run_id)
    transport = VllmTransport(CFG, control, lambda: unique_state(model), torch.float32)
    thread, stop, errors = run_in_thread(actor)
    try:
        wait_until(
            lambda: [m.actor_id for m in control.members()] == ["actor-0"], 60, "the actor to announce"
        )
        assert actor.engine.loaded_version == 1, "it loads the newest file generation before it announces"
        _perturb(model, 2)
        policies[2] = copy.deepcopy(model)
        result = transport.send(2)
        assert result.ok and result.group_size == 1, result.error
        assert actor.engine.loaded_version == 2
        # groups finished before the transfer may still wait to be scored and pushed (up to a few x
        # max_inflight_prompts of them): drain until a group carrying version-2 tokens has arrived
        groups: list = []

        def _has_v2() -> bool:
            groups.extend(drain(redis_url, run_id, 2))
            versions = [t.versions if t.versions is not None else [g.policy_version] for g in groups
                        for t in g.trajectories]  # fmt: skip
            return any(2 in v for v in versions)

        wait_until(_has_v2, 180, "a group generated after the transfer")
        assert registry.get_sample_value("offpolicy_actor_transfers_total") == 1
    finally:
        stop.set()
        thread.join(60)
        transport.close()
        actor.close()
        store.close()
    assert not errors, errors
    groups += drain(redis_url, run_id, 2)
    seen: set[int] = set()
    checked, teeth = 0, 0.0
    for g in groups:
        batch = collate([g], pad_token_id=0)
        with torch.no_grad():
            lps = {v: token_logprobs(m, batch) for v, m in policies.items()}  # (n, R) per version
        oldest = []
        for i, t in enumerate(g.trajectories):
            versions = (
                t.versions if t.versions is not None else np.full(len(t.response_ids), g.policy_version)
            )
            oldest.append(int(versions.min()))  # a completion may start after the update (all v2)
            for j, v in enumerate(versions.tolist()):
                seen.add(v)
                assert abs(float(lps[v][i, j]) - float(t.behavior_logprobs[j])) < 1e-4, (v, i, j)
                if v == 2:
                    teeth = max(teeth, abs(float(lps[1][i, j]) - float(t.behavior_logprobs[j])))
                checked += 1
        assert g.policy_version == min(oldest), "the group is stamped with its oldest token's version"
    assert 2 in seen and checked > 50
    assert teeth > 1e-3, "the v2 tokens' log-probs under v1's weights must differ (the check has teeth)"
