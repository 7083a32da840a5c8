"""The learner with `publish.transport: vllm` (real Redis, no actor in the group yet): every version goes to
the transport, a file generation is written only every `persist_every` publishes (and at the start and at
checkpoints), the policy record names the newest file generation, and the transfer metrics are exported."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model, make_tiny_model
from offpolicy.learner.trainer import Learner
from offpolicy.weights.record import PolicyStore
from tests.integration.learner.test_loop import TINY, config, make_groups

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", **TINY)


@pytest.fixture(scope="module")
def behaviour(tiny_dir):
    return load_model(tiny_dir, "cpu").eval()


def _run(cfg, groups, registry, steps: int) -> Learner:
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg, registry=registry)
    try:
        for _ in range(steps):
            learner.step()
    finally:
        learner.close()
    return learner


@pytest.mark.parametrize(("transport", "files"), [("vllm", ["v0", "v3"]), ("files", None)])
def test_transport_decides_which_versions_become_file_generations(
    transport, files, tiny_dir, behaviour, redis_url, tmp_path
):
    publish = {
        "weights_dir": str(tmp_path / "weights"),
        "keep_versions": 10,
        "transport": transport,
        "persist_every": 3,
        "transfer": {"backend": "gloo", "timeout_s": 5.0},
    }
    cfg = config(
        tiny_dir, redis_url, tmp_path, publish=publish, checkpoint={"checkpoint_dir": None}, groups_per_step=1
    )
    registry = CollectorRegistry()
    learner = _run(cfg, make_groups(behaviour, 4, version=0, seed=1), registry, 4)
    assert learner.version == 4
    written = sorted(p.name for p in (tmp_path / "weights").iterdir())
    record = PolicyStore(redis_url, cfg.run_id).read()
    sample = registry.get_sample_value
    if transport == "vllm":
        assert written == files and record.version == 3
        assert sample("offpolicy_learner_transfer_group_size") == 0  # nobody announced themselves
        assert sample("offpolicy_learner_transfer_failures_total") == 0
    else:
        assert written[-1] == "v4" and record.version == 4 and len(written) >= 3
        assert sample("offpolicy_learner_transfer_group_size") is None  # no transport, no metrics
