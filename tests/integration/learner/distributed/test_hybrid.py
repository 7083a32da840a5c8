"""Hybrid sharding (`fsdp.replicate: 2`) on 4 ranks (torchrun, FSDP2 over a 2 x 2 mesh, gloo): shards within
a pair of consecutive ranks (a node's), replicas across the pairs; it trains like one process on the same
groups, publishes through rank 0's shard group, and its sharded checkpoint resumes on 2 ranks of a flat
mesh (DCP reshards)."""

from __future__ import annotations

import pytest
import yaml

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.persist.version_folders import version_dir
from offpolicy.learner.trainer import Learner
from tests.integration.learner.distributed.test_fsdp import (  # noqa: F401 (groups, tiny2: fixtures)
    STEPS,
    TOLERANCE,
    groups,
    make_config,
    tiny2,
    torchrun,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_two_by_two_hybrid_trains_like_one_process_and_resumes_flat(tiny2, groups, redis_url, tmp_path):  # noqa: F811
    one = make_config(tiny2, redis_url, tmp_path, "one")
    four = make_config(tiny2, redis_url, tmp_path, "four", fsdp={"replicate": 2})
    for cfg in (one, four):
        with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
            buf.insert_many(groups)
    learner = Learner(one)
    try:
        for _ in range(STEPS):
            learner.step()
        expected = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    finally:
        learner.close()
    (tmp_path / "four.yaml").write_text(yaml.safe_dump(four.model_dump(mode="json")))
    log = tmp_path / "four.log"
    assert torchrun(4, tmp_path / "four.yaml", log, timeout=600) == 0, log.read_text()[-4000:]
    assert "hybrid sharding: 2 replica groups of 2 ranks" in log.read_text()
    got = load_model(version_dir(four.weights_path, 2 * STEPS), "cpu").state_dict()
    diffs = {k: float((got[k] - v).abs().max()) for k, v in expected.items()}
    moved = max(float((got[k] - v).abs().max()) for k, v in load_model(tiny2, "cpu").state_dict().items())
    assert moved > 20 * TOLERANCE
    assert max(diffs.values()) <= TOLERANCE, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert checkpoint_versions(four.checkpoint_path) == [4]

    # the 4-rank hybrid checkpoint, read by 2 ranks of one flat mesh: the remaining groups train on
    flat = four.model_copy(update={"fsdp": four.fsdp.model_copy(update={"replicate": 1}), "max_steps": 1})
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump(flat.model_dump(mode="json")))
    log = tmp_path / "flat.log"
    assert torchrun(2, tmp_path / "flat.yaml", log, timeout=300) == 0, log.read_text()[-4000:]
    assert "ckpt-0000000004 at version 4" in log.read_text()
    resumed = load_model(version_dir(four.weights_path, 2 * STEPS), "cpu").state_dict()
    # step 3 again, on the same groups (redelivered) from the same state: the same weights
    assert max(float((resumed[k] - v).abs().max()) for k, v in expected.items()) <= TOLERANCE
