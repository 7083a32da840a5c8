"""`transfer.backend: gloo_m2n` from a learner on 2 ranks (torchrun, FSDP2 over gloo) into a real vLLM
engine on CPU, with real Redis: every learner rank sends its own shards to the actor's worker (no rank
gathers the full weights), which puts the tensors together and loads them. After the update the engine
generates exactly what the same engine generates from the same version's file generation (greedy, the
log-probs bit for bit), which differs from what it generated before; every token records the version.
Then `kill -9` of the actor's engine: the next send fails on both learner ranks within its bound, and once
the membership lapsed both ranks find no one to send to; nothing hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.load import unique_state
from offpolicy.weights.config import TransferConfig
from tests.integration.learner.distributed.torchrun import (
    ROOT,
    SCRIPTS,
    run_script,
    torchrun_argv,
    torchrun_env,
)
from tests.integration.weights.test_transfer_vllm import Actor

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow, pytest.mark.usefixtures("vllm_plugin")]
CFG = TransferConfig(backend="gloo_m2n", timeout_s=15.0, heartbeat_s=0.5, bucket_bytes=1 << 20)


def test_two_learner_ranks_send_their_shards_into_a_vllm_engine(tmp_path, redis_url, run_id):
    model_dir = make_tiny_model(tmp_path / "model")
    weights, out = tmp_path / "weights", tmp_path / "rank"
    actor = Actor("A", str(model_dir), 0, redis_url, run_id, cfg=CFG)
    try:
        before = actor.generate()
        actor.start()
        script = str(SCRIPTS / "m2n_ranks.py")
        log = (tmp_path / "ranks.log").open("w")
        proc = subprocess.Popen(
            torchrun_argv(script, str(model_dir), redis_url, run_id, str(weights), str(out)),
            cwd=ROOT, env=torchrun_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while not Path(f"{out}.sent").exists():
                assert proc.poll() is None and time.monotonic() < deadline, _tail(tmp_path / "ranks.log")
                time.sleep(0.2)
            after = actor.generate()
            assert actor.engine.loaded_version == 2
            # the same engine from v1's files (v2 holds the same weights)
            folder = next(weights.glob("v*1"))

            async def reload():
                async with actor.engine.paused():
                    await actor.engine.reload_weights(str(folder), 2)

            actor.engine.call(reload())
            from_files = actor.generate()
            for pid in actor.engine_pids():  # kill -9 of the engine (and its worker)
                for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                    os.kill(p.pid, signal.SIGKILL)
            Path(f"{out}.killed").touch()
            assert proc.wait(timeout=180) == 0, _tail(tmp_path / "ranks.log")
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        actor.close()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:  # v1, v2 sent (v2 through the group v1 formed); v3 failed everywhere; v4 to no one
        results = rank["results"]
        assert [r["ok"] for r in results] == [True, True, False, True], results
        assert [r["epoch"] for r in results[:2]] == [1, 1]
        assert results[2]["seconds"] < CFG.timeout_s + 5, results[2]
        assert results[3]["seconds"] < 1.0, results[3]
    assert [r["group_size"] for r in ranks[0]["results"]] == [1, 1, 1, 0]
    assert (ranks[0]["trainers"], ranks[0]["trainer_rank"], ranks[1]["trainer_rank"]) == (2, 0, 1)
    # every rank sent its own shards (rank 1 too): each no more than its shards, together the whole model
    full = sum(t.numel() * 4 for t in unique_state(_load(model_dir)).values())
    sent = [rank["results"][0]["own_bytes"] for rank in ranks]
    assert all(0 < b < full for b in sent) and sum(sent) == full, (sent, full)
    assert [rank["results"][0]["bytes"] for rank in ranks] == [full, full]  # the send's total, on every rank
    assert sent[1] == ranks[1]["local_shard_bytes"]
    # nccl_m2n (GPUs only) reads the same shards through vLLM's own M2N source classes, cast to the publish
    # dtype, each rank its rows over a (2, 1) mesh; its trainer init info is accepted
    for r, rank in enumerate(ranks):
        m2n = rank["nccl_m2n"]
        assert m2n["mesh_dims"] == [2, 1] and m2n["names_match"] and m2n["dtypes"] == ["torch.bfloat16"]
        assert m2n["placements"] == ["(0, -1)"], m2n["placements"]  # Shard(0) over the trainer axis
        assert m2n["local_bytes"] * 2 == rank["local_shard_bytes"]
        assert m2n["init"] == [r, 2, 3]
    for (ids, lps, versions), (f_ids, f_lps, _), (_, _, _) in zip(after, from_files, before, strict=True):
        assert ids == f_ids
        np.testing.assert_array_equal(lps, f_lps)
        assert versions is not None and (versions == 2).all()
    assert [o[0] for o in after] != [o[0] for o in before]  # the update changed what the engine generates


@pytest.mark.parametrize(("replicate", "trainers", "senders"), [(1, 2, [0, 1]), (2, 1, [0, None])])
def test_each_rank_sends_exactly_its_rows(tmp_path, replicate, trainers, senders):
    """Flat: both ranks send their rows (as `torch.chunk` cuts them), together the full weights; hybrid
    (each rank a whole replica): the first replica group, rank 0, sends everything, rank 1 nothing."""
    model_dir = make_tiny_model(tmp_path / "model")
    out = tmp_path / "shards"
    run_script("local_shards_ranks.py", str(model_dir), str(replicate), str(out))
    got = [json.loads((tmp_path / f"shards{r}.json").read_text()) for r in (0, 1)]
    assert [g["trainer_rank"] for g in got] == senders
    for g in got:
        assert g["trainers"] == trainers and g["names_match"] and g["sizes_match"] and g["exact"], g
        assert g["placements"] == ["0"]  # every tensor of the tiny model is a sharded parameter


def _tail(path: Path) -> str:
    return path.read_text()[-3000:]


def _load(model_dir: Path) -> torch.nn.Module:
    from offpolicy.learner.model import load_model

    return load_model(str(model_dir), "cpu", torch.float32)
