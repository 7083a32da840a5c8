"""`transfer.backend: gloo` (a broadcast from rank 0) from a learner on 2 ranks (torchrun, FSDP2 over gloo)
into a real vLLM engine on CPU, with real Redis, through the learner's own publish path: every version is
gathered to rank 0 in the background (persist/rank_gathers.py) and sent at a later step boundary; versions
due as files are written from the same gathered copy. After the last send the engine generates exactly what
it generates from that version's file generation (greedy, the log-probs bit for bit), which differs from
what it generated before; every token records the version."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from offpolicy.learner.model import make_tiny_model
from tests.integration.learner.distributed.torchrun import ROOT, SCRIPTS, torchrun_argv, torchrun_env
from tests.integration.weights.test_transfer_vllm import Actor

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow, pytest.mark.usefixtures("vllm_plugin")]


def test_two_learner_ranks_gather_in_the_background_and_rank_0_sends_into_a_vllm_engine(
    tmp_path, redis_url, run_id
):
    model_dir = make_tiny_model(tmp_path / "model")
    weights, out = tmp_path / "weights", tmp_path / "rank"
    actor = Actor("A", str(model_dir), 0, redis_url, run_id)
    try:
        before = actor.generate()
        actor.start()
        log = (tmp_path / "ranks.log").open("w")
        script = str(SCRIPTS / "kept_vllm_ranks.py")
        argv = torchrun_argv(script, str(model_dir), redis_url, run_id, str(weights), str(out))
        proc = subprocess.Popen(argv, cwd=ROOT, env=torchrun_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not Path(f"{out}.sent").exists():
                assert proc.poll() is None and time.monotonic() < deadline, _tail(tmp_path / "ranks.log")
                time.sleep(0.2)
            after = actor.generate()
            loaded = actor.engine.loaded_version
            folder = next(weights.glob("v*3"))

            async def reload():
                async with actor.engine.paused():
                    await actor.engine.reload_weights(str(folder), 3)

            actor.engine.call(reload())
            from_files = actor.generate()
            Path(f"{out}.done").touch()
            assert proc.wait(timeout=120) == 0, _tail(tmp_path / "ranks.log")
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        actor.close()
    result = json.loads(Path(f"{out}.json").read_text())
    assert [(r["version"], r["ok"], r["group_size"]) for r in result["results"]] == [
        (1, True, 1), (2, True, 1), (3, True, 1)
    ]  # fmt: skip
    assert result["written"] == [1, 3]  # persist_every 2: v2 was sent, not written
    assert loaded == 3
    for (ids, lps, versions), (f_ids, f_lps, _) in zip(after, from_files, strict=True):
        assert ids == f_ids
        np.testing.assert_array_equal(lps, f_lps)
        assert versions is not None and (versions == 3).all()
    assert [o[0] for o in after] != [o[0] for o in before]  # the updates changed what the engine generates


def _tail(path: Path) -> str:
    return path.read_text()[-3000:]
