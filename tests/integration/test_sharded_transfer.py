"""`transfer.backend: gloo_m2n` from a learner on 2 ranks (torchrun, FSDP2 over gloo) into a real vLLM
engine on CPU, with real Redis: every learner rank sends its own shards to the actor's worker (no rank
gathers the full weights), which puts the tensors together and loads them. After the update the engine
generates exactly what the same engine generates from the same version's file generation (greedy, the
log-probs bit for bit), which differs from what it generated before; every token records the version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from config.transfer import TransferConfig
from learner.model import make_tiny_model
from learner.model.load import unique_state
from tests.integration.test_transfer_vllm import Actor, vllm_plugin  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CFG = TransferConfig(backend="gloo_m2n", timeout_s=30.0, heartbeat_s=0.5, bucket_bytes=1 << 20)


def test_two_learner_ranks_send_their_shards_into_a_vllm_engine(tmp_path, redis_url, run_id):
    model_dir = make_tiny_model(tmp_path / "model")
    weights, out = tmp_path / "weights", tmp_path / "rank"
    actor = Actor("A", str(model_dir), 0, redis_url, run_id, cfg=CFG)
    try:
        before = actor.generate()
        actor.start()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        script = str(ROOT / "tests" / "integration" / "m2n_ranks.py")
        proc = subprocess.run(
            [*cmd, script, str(model_dir), redis_url, run_id, str(weights), str(out)],
            cwd=ROOT, env=env | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        (tmp_path / "ranks.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
        after = actor.generate()
        assert actor.engine.loaded_version == 2
        # the same engine from v1's files (v2 holds the same weights)
        folder = next(weights.glob("v*1"))

        async def reload():
            async with actor.engine.paused():
                await actor.engine.reload_weights(str(folder), 2)

        actor.engine.call(reload())
        from_files = actor.generate()
    finally:
        actor.close()
    for rank in ranks:  # both ranks' sends succeeded; v2 went through the group v1 formed
        assert [r["ok"] for r in rank["results"]] == [True, True], rank["results"]
        assert [r["epoch"] for r in rank["results"]] == [1, 1]
    assert [r["group_size"] for r in ranks[0]["results"]] == [1, 1]
    assert (ranks[0]["trainers"], ranks[0]["trainer_rank"], ranks[1]["trainer_rank"]) == (2, 0, 1)
    # every rank sent its own shards (rank 1 too): each no more than its shards, together the whole model
    full = sum(t.numel() * 4 for t in unique_state(_load(model_dir)).values())
    sent = [rank["results"][0]["bytes"] for rank in ranks]
    assert all(0 < b < full for b in sent) and sum(sent) == full, (sent, full)
    assert sent[1] == ranks[1]["local_shard_bytes"]
    for (ids, lps, versions), (f_ids, f_lps, _), (_, _, _) in zip(after, from_files, before, strict=True):
        assert ids == f_ids
        np.testing.assert_array_equal(lps, f_lps)
        assert versions is not None and (versions == 2).all()
    assert [o[0] for o in after] != [o[0] for o in before]  # the update changed what the engine generates


def _load(model_dir: Path) -> torch.nn.Module:
    from learner.model import load_model

    return load_model(str(model_dir), "cpu", torch.float32)
