"""`offpolicy learner --nproc-per-node 2`: the service on 2 ranks (torchrun, FSDP2, gloo).

It answers its API while it trains, `/metrics` shows one learner, a PATCH lands at the same step on both
ranks; `kill -9` of rank 1 ends the job (torchrun stops rank 0: no hang), and a restarted service resumes
from the newest sharded checkpoint: the version continues and no group's use is counted twice.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.services.children import free_port
from tests.integration.learner.distributed.test_fsdp import kill_tree, tiny2  # noqa: F401
from tests.integration.learner.test_loop import config
from tests.integration.services.test_learner import random_group, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[4]
TOKEN = "fsdp-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start(cfg_file: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OFFPOLICY_API_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "learner", "--nproc-per-node", "2"]
    return subprocess.Popen(
        [*cmd, "--config", str(cfg_file), "--port", str(port)],
        cwd=ROOT, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def status(port: int) -> dict | None:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def rank_pid(agent: subprocess.Popen, rank: int) -> int:
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "offpolicy.services.learner_api" in " ".join(
                child.cmdline()
            ):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under torchrun {agent.pid}")


def test_service_on_two_ranks_patch_kill_rank_1_and_resume(tiny2, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny2,
        redis_url,
        tmp_path,
        groups_per_step=2,
        micro_batch_size=2,
        optimizer={"lr": 1e-4},
        torch_threads=1,
        sample_timeout_s=0.5,
        buffer={"sampler": "fifo", "max_times_sampled": 1},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 2},
    )
    cfg_file = tmp_path / "learner.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    buf = ReplayBuffer(redis_url, cfg.run_id, cfg.buffer)
    log, port = tmp_path / "service.log", free_port()
    agent = start(cfg_file, port, log)
    try:
        wait_for(lambda: (s := status(port)) is not None and s["state"] == "waiting_for_data", 180)
        assert status(port)["world_size"] == 2
        buf.insert_many([random_group(0, seed) for seed in range(8)])
        wait_for(
            lambda: (s := status(port)) is not None and s["step"] >= 2, 120
        )  # the API answers while it trains
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert len(re.findall(r"^offpolicy_learner_policy_version[ {]", metrics, re.M)) == 1  # one learner

        patch = httpx.patch(
            f"http://127.0.0.1:{port}/v1/config", json={"optimizer": {"lr": 2e-4}}, headers=AUTH, timeout=10
        )
        assert patch.status_code == 202, patch.text  # accepted: applied at the next step boundary
        version = patch.json()["config_version"]
        buf.insert_many([random_group(0, seed) for seed in range(8, 16)])
        wait_for(
            lambda: (s := status(port)) is not None and s["config_version"] == version and s["step"] >= 6, 120
        )
        applied = re.findall(rf"rank (\d) applied config version {version} at step (\d+)", log.read_text())
        assert sorted(r for r, _ in applied) == ["0", "1"], applied
        assert len({s for _, s in applied}) == 1, applied  # the same step boundary on both ranks

        buf.insert_many([random_group(0, seed) for seed in range(16, 40)])
        wait_for(lambda: checkpoint_versions(cfg.checkpoint_path)[-1:] >= [8], 120)
        os.kill(rank_pid(agent, 1), signal.SIGKILL)  # mid-run
        assert agent.wait(timeout=120) != 0  # torchrun ended the job: rank 0 did not hang
    finally:
        kill_tree(agent)
    killed = buf.stats()
    resumed_from = checkpoint_versions(cfg.checkpoint_path)[-1]

    offset = len(log.read_text())
    agent = start(cfg_file, port, log)
    try:
        wait_for(lambda: (s := status(port)) is not None and s["state"] != "starting", 180)
        first = status(port)
        assert first["policy_version"] >= resumed_from  # resumed: the version continues, never restarts
        buf.insert_many([random_group(0, seed) for seed in range(40, 44)])
        wait_for(lambda: (s := status(port)) is not None and s["policy_version"] > resumed_from + 2, 120)
        agent.send_signal(signal.SIGTERM)  # torchrun signals both ranks; the leader stops them in step
        agent.wait(timeout=120)  # torchrun itself exits non-zero after a signal, whatever its ranks did
    finally:
        kill_tree(agent)
    second = log.read_text()[offset:]
    assert "SIGTERM: stopping when the leader says so" in second  # rank 1 waited for the leader
    assert "Application shutdown complete" in second and "the loop died" not in second, second[-3000:]
    final = buf.stats()
    buf.close()
    # the killed job held leases it had not acked (outstanding, or released by rank 0 as it closed): they
    # were not counted as uses
    assert killed.leased_total > killed.acked_total
    # max_times_sampled = 1: each acked use removed its group, no use counted twice, nothing lost
    assert final.evicted_total.get("max_times_sampled", 0) == final.sampled_total == final.acked_total
    assert final.sampled_total + final.size == final.inserted_total == 44
    assert final.leases_outstanding == 0 and final.redelivered_total > 0
