"""Training and the background publish gather interleaved on 2 ranks (torchrun, FSDP2 over gloo): 30 steps
with `publish_every: 1` and the files transport, so a gather of a version to rank 0 is under way while
every next step trains (persist/background_gather.py: the gather runs over a gloo group of its own, from
host memory, on a helper thread). Nothing hangs, every version is published or coalesced into a newer one,
and no step waits on a publish longer than one step takes. The shard snapshots take at most two host sets for
the whole run (one gathering, one waiting), reused version after version (weights/host_buffers.py)."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from offpolicy.buffer.replay_buffer import ReplayBuffer
from tests.integration.learner.distributed.test_fsdp import groups, tiny2  # noqa: F401 (fixtures)
from tests.integration.learner.distributed.torchrun import run_script
from tests.integration.learner.test_loop import config

pytestmark = [pytest.mark.redis, pytest.mark.slow]

STEPS = 30


def test_publishing_each_of_30_steps_never_waits_a_step(tiny2, groups, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny2, redis_url, tmp_path,
        groups_per_step=2, mini_batch_groups=2, micro_batch_size=4, optimizer={"lr": 1e-4}, torch_threads=1,
        buffer={"sampler": "fifo", "max_times_sampled": None},  # 12 groups, sampled again and again
        publish={"weights_dir": str(tmp_path / "weights"), "keep_versions": 2, "publish_every": 1},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 10},
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "out.json"
    run_script("interleave_ranks.py", str(tmp_path / "cfg.yaml"), str(STEPS), str(out), timeout=600)
    result = json.loads(out.read_text())
    assert result["version"] == STEPS and result["published"] == STEPS, result
    # one gathering + one waiting at most, reused: 30 versions' shard snapshots from at most 2 allocations
    assert 1 <= result["host_sets_made"] <= 2 and 1 <= result["host_sets_kept"] <= 2, result
    steps = result["steps"][1:]  # the first step builds what the others reuse
    step_s = statistics.median(sum(s["phases"].values()) for s in steps)
    publish = [s["phases"]["publish"] for s in steps]
    assert max(publish) <= step_s, (max(publish), step_s, publish)
    assert max(s["wall_s"] for s in steps) <= 4 * step_s + 1.0, [s["wall_s"] for s in steps]
