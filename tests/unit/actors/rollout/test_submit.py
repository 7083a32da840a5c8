"""make_groups (hermetic): stamping, reward per completion, a failing reward drops only its group."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from offpolicy.actors.config import SamplingConfig
from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.engine.vllm import Completion
from offpolicy.actors.metrics import ActorMetrics
from offpolicy.actors.rollout.rewards import target_token_share
from offpolicy.actors.rollout.submit import make_groups, stamped_sampling
from offpolicy.buffer.codec import decode_group, encode_group
from offpolicy.buffer.types import SamplingParams


def _completion(text: str) -> Completion:
    ids = np.arange(len(text), dtype=np.int32)
    return Completion(ids, np.full(len(text), -0.5, np.float32), "length", text)


def test_groups_are_stamped_scored_and_a_failing_reward_drops_only_its_group():
    registry = CollectorRegistry()
    prompts = [Prompt(0, "p0", "x", "a", {"k": "v"}), Prompt(1, "p1", "y", None), Prompt(2, "p2", "z", "b")]
    ids = [np.array([1, 2], np.int32), np.array([3], np.int32), np.array([4], np.int32)]
    completions = [[_completion("aab"), _completion("bbbb")], [_completion("a")], [_completion("ab")]]
    sampling = stamped_sampling(SamplingConfig(temperature=0.7, max_tokens=4, n=2))
    groups = make_groups(
        prompts, ids, completions, target_token_share, 7, "actor-3", sampling, ActorMetrics(registry)
    )
    assert [g.prompt_id for g in groups] == ["p0", "p2"]  # p1 has no target: reward_error
    assert registry.get_sample_value("offpolicy_actor_failures_total", {"reason": "reward_error"}) == 1
    g = groups[0]
    assert (g.policy_version, g.actor_id, g.metadata) == (7, "actor-3", {"k": "v"})
    assert g.sampling == SamplingParams(0.7, 1.0, -1, 4)
    assert [t.reward for t in g.trajectories] == [2 / 3, 0.0]
    assert len({g.group_id for g in groups}) == 2
    assert registry.get_sample_value("offpolicy_actor_reward_count") == 3
    assert registry.get_sample_value("offpolicy_actor_reward_sum") == 2 / 3 + 0.0 + 0.5
    decode_group(encode_group(g))  # valid for the buffer's codec


def test_a_group_spanning_versions_is_stamped_with_its_oldest_token_and_per_token_versions():
    from offpolicy.actors.rollout.submit import make_group

    def comp(versions):
        v = np.asarray(versions, np.int32)
        return Completion(
            np.arange(len(v), dtype=np.int32), np.full(len(v), -0.1, np.float32), "length", "a", v
        )

    sampling = stamped_sampling(SamplingConfig(temperature=0.7, max_tokens=4, n=2))
    prompt, ids = Prompt(0, "p0", "x", "a"), np.array([1], np.int32)
    g = make_group(prompt, ids, [comp([3, 3, 4]), comp([4, 4])], target_token_share, 3, "a0", sampling)
    assert g.policy_version == 3
    assert [t.versions.tolist() for t in g.trajectories] == [[3, 3, 4], [4, 4]]
    decode_group(encode_group(g))
    # one version only (here newer than at admission): no per-token versions, the version is the tokens'
    g = make_group(prompt, ids, [comp([5, 5]), comp([5])], target_token_share, 4, "a0", sampling)
    assert g.policy_version == 5 and all(t.versions is None for t in g.trajectories)
