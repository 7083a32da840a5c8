"""The learner on two "nodes" of one machine: two torchrun agents (`offpolicy learner --nnodes 2
--node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT --nproc-per-node 1`) meeting at torchrun's c10d rendezvous.

They train like the one-process learner on the same groups (published weights within 1e-5 after 3 steps);
global rank 0 is on node 0 whatever order the rendezvous put the agents in, and only it serves the API;
`kill -9` of node 1's rank ends the job on both nodes; the learner restarted at another world size (one
process) resumes from the sharded checkpoint the two nodes wrote into their shared folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.persist.version_folders import version_dir
from offpolicy.learner.trainer import Learner
from offpolicy.services.children import free_port
from tests.integration.learner.distributed.test_fsdp import (  # noqa: F401 (groups, tiny2: fixtures)
    STEPS,
    TOLERANCE,
    groups,
    kill_tree,
    make_config,
    tiny2,
)
from tests.integration.services.test_learner import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[4]
LAYOUT_VARS = (
    "OFFPOLICY_NNODES",
    "OFFPOLICY_NODE_RANK",
    "OFFPOLICY_RDZV_ENDPOINT",
    "OFFPOLICY_NPROC_PER_NODE",
)


def service(cfg_file: Path, port: int, log: Path, *layout: str) -> subprocess.Popen:
    """`offpolicy learner` with `layout` flags; its loop's death exits the process after 1 s."""
    env = {k: v for k, v in os.environ.items() if k not in LAYOUT_VARS}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OFFPOLICY_FATAL_EXIT_GRACE_S": "1"}
    cmd = [
        sys.executable,
        "-m",
        "offpolicy.services.cli",
        "learner",
        *layout,
        "--config",
        str(cfg_file),
        "--port",
        str(port),
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)


def status(port: int) -> dict | None:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def ranks_under(agent: subprocess.Popen) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(agent.pid).children(recursive=True)
        if "offpolicy.services.learner_api" in " ".join(p.cmdline())
    ]


def test_two_nodes_like_one_process_serve_on_node_0_end_and_resume(tiny2, groups, redis_url, tmp_path):  # noqa: F811
    """Train like one process, serve on node 0 alone, end together, resume at another world size."""
    one = make_config(tiny2, redis_url, tmp_path, "one")
    two = make_config(tiny2, redis_url, tmp_path, "two", max_steps=None)
    for cfg in (one, two):
        with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
            buf.insert_many(groups)
    learner = Learner(one)
    try:
        for _ in range(STEPS):
            learner.step()
        expected = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    finally:
        learner.close()

    cfg_file = tmp_path / "two.yaml"
    cfg_file.write_text(yaml.safe_dump(two.model_dump(mode="json")))
    endpoint, ports = f"127.0.0.1:{free_port()}", [free_port(), free_port()]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    rdzv = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", f"t-{uuid.uuid4().hex[:8]}"]
    agents: list[subprocess.Popen] = []
    try:
        for node in (1, 0):  # node 1's agent first: the rendezvous need not number it second
            agents.insert(0, service(cfg_file, ports[node], logs[node], *rdzv, "--node-rank", str(node),
                                     "--nproc-per-node", "1"))  # fmt: skip
            time.sleep(1)
        wait_for(lambda: (s := status(ports[0])) is not None and s["policy_version"] >= 2 * STEPS, 300)
        s = status(ports[0])
        assert s["world_size"] == 2 and s["policy_version"] == 2 * STEPS
        assert status(ports[1]) is None  # node 1 serves nothing: its rank follows rank 0
        # global rank = node rank x ranks per node + local rank, whatever order the rendezvous chose
        assert "start-up host memory: rank 0 " in logs[0].read_text()
        assert "start-up host memory: rank 1 " in logs[1].read_text()
        assert "Application startup complete" not in logs[1].read_text()
        got = load_model(version_dir(two.weights_path, 2 * STEPS), "cpu").state_dict()
        diffs = {k: float((got[k] - v).abs().max()) for k, v in expected.items()}
        moved = max(float((got[k] - v).abs().max()) for k, v in load_model(tiny2, "cpu").state_dict().items())
        assert moved > 20 * TOLERANCE
        assert max(diffs.values()) <= TOLERANCE, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
        wait_for(lambda: checkpoint_versions(two.checkpoint_path) == [4], 60)  # DCP, both nodes' shards

        (victim,) = ranks_under(agents[1])
        os.kill(victim.pid, signal.SIGKILL)  # rank 1, on node 1, while rank 0 waits for data
        assert agents[1].wait(timeout=120) != 0  # node 1's torchrun: its rank failed, no restarts left
        assert agents[0].wait(timeout=120) != 0  # node 0: rank 0's next collective failed, it exited
        assert "the loop died" in logs[0].read_text()
    finally:
        for agent in agents:
            kill_tree(agent)

    # another world size: one process reads the checkpoint the two nodes wrote (DCP reshards)
    log = tmp_path / "single.log"
    proc = service(cfg_file, ports[0], log)
    try:
        wait_for(lambda: (s := status(ports[0])) is not None and s["state"] != "starting", 180)
        assert status(ports[0])["world_size"] == 1
        assert f"resumed from {two.checkpoint_path / 'ckpt-0000000004'} at version 4" in log.read_text()
        wait_for(lambda: (s := status(ports[0])) is not None and s["policy_version"] >= 2 * STEPS, 120)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        kill_tree(proc)
    with ReplayBuffer(redis_url, two.run_id, two.buffer) as buf:
        stats = buf.stats()
    lines = [json.loads(line) for line in Path(two.metrics_jsonl).read_text().splitlines()]
    # 3 steps on two nodes, then the resumed learner trained step 3's groups again (v4 -> v6)
    assert [int(m["version"]) for m in lines] == [2, 4, 6, 6]
    # nothing lost, nothing counted twice: 8 groups acked with checkpoint v4; the last 4 trained twice but
    # in no checkpoint yet (checkpoint_every 2), so given back at each stop, waiting in the buffer
    assert (stats.acked_total, stats.size, stats.leases_outstanding) == (8, 4, 0)


def test_max_restarts_restarts_both_nodes_from_the_checkpoint(tiny2, groups, redis_url, tmp_path):  # noqa: F811
    cfg = make_config(tiny2, redis_url, tmp_path, "two", max_steps=None)
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    cfg_file = tmp_path / "two.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    endpoint, ports = f"127.0.0.1:{free_port()}", [free_port(), free_port()]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    rdzv = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc-per-node", "1", "--max-restarts", "1"]
    agents = [service(cfg_file, ports[n], logs[n], *rdzv, "--node-rank", str(n)) for n in (0, 1)]
    try:
        wait_for(lambda: checkpoint_versions(cfg.checkpoint_path) == [4], 300)
        wait_for(lambda: (s := status(ports[0])) is not None and s["policy_version"] >= 2 * STEPS, 120)
        (victim,) = ranks_under(agents[1])
        os.kill(victim.pid, signal.SIGKILL)
        # node 1's agent restarts its rank and re-enters the rendezvous; node 0's agent sees a node
        # waiting and restarts rank 0: the whole job starts again and resumes from checkpoint v4
        resumed = f"resumed from {cfg.checkpoint_path / 'ckpt-0000000004'} at version 4"
        wait_for(lambda: resumed in logs[0].read_text(), 300)
        wait_for(lambda: (s := status(ports[0])) is not None and s["state"] != "starting", 180)
        assert status(ports[0])["world_size"] == 2 and agents[0].poll() is None and agents[1].poll() is None
        (restarted,) = ranks_under(agents[1])
        assert restarted.pid != victim.pid
        assert status(ports[1]) is None
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=60)
            kill_tree(agent)


def test_two_nodes_with_one_node_rank_fail_at_once_on_both(tiny2, redis_url, tmp_path):  # noqa: F811
    cfg = make_config(tiny2, redis_url, tmp_path, "two", max_steps=None)
    cfg_file = tmp_path / "two.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    endpoint = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    rdzv = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc-per-node", "1", "--node-rank", "0"]
    agents = [service(cfg_file, free_port(), log, *rdzv) for log in logs]
    try:
        assert [a.wait(timeout=180) != 0 for a in agents] == [True, True]
    finally:
        for agent in agents:
            kill_tree(agent)
    for log in logs:
        assert "global rank 0 is claimed twice" in log.read_text()
