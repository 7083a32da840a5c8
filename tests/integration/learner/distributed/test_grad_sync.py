"""Gradient reductions of a learner on 2 ranks (torchrun, FSDP2, gloo): with `fsdp.grad_sync: mini_batch`
(what `auto` takes when the memory plan fits) every FSDP unit reduce-scatters once per optimizer step, at
its last micro-batch; with `micro_batch` once per micro-batch. Counted by the profiler on FSDP2's own
reduce ranges. The 2-rank == 1-process equivalence tests (test_fsdp.py) run under `auto`."""

from __future__ import annotations

import json

import pytest
import yaml

from offpolicy.buffer.replay_buffer import ReplayBuffer
from tests.integration.learner.distributed.test_fsdp import groups, make_config, tiny2  # noqa: F401 (fixtures)
from tests.integration.learner.distributed.torchrun import run_script

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["mini_batch", "micro_batch"])
def test_gradients_are_reduced_once_per_optimizer_step(tiny2, groups, redis_url, tmp_path, mode):  # noqa: F811
    # 4 groups of 4 per step, 2 mini-batches of 2 groups: each rank trains 4 rows per mini-batch in
    # micro-batches of 3 rows, so 2 micro-batches per optimizer step
    cfg = make_config(tiny2, redis_url, tmp_path, mode, max_steps=1, fsdp={"grad_sync": mode}, packing=False)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups[:4])
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "out.json"
    run_script("grad_sync_ranks.py", str(tmp_path / "cfg.yaml"), str(out))
    result = json.loads(out.read_text())
    assert result["grad_sync"] == mode and result["optimizer_steps"] == 2
    assert result["units"] == 3  # two decoder layers and the root
    per_step = 1 if mode == "mini_batch" else 2
    assert result["reductions_per_unit"] == [per_step * result["optimizer_steps"]], result
