"""docs/deploy.md "Sizing": the table is what deploy/sizing.py computes, its per-group bytes are what the
buffer's codec writes, and the shipped manifests' sizes (volumes, Redis maxmemory and limit, learner and
actor GPUs, learner pod memory) are its rows: the one-pod overlays the 7B row, the multi-node JobSet the
70B row."""

from __future__ import annotations

import itertools
import time

import numpy as np

from deploy.checks import ROOT, kustomize, load_compose, read_env_file
from deploy.sizing import DEFAULT, GROUP_OVERHEAD, ROWS, group_bytes, size, table
from offpolicy.buffer.codec import encode_group
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.config import load_config

SIZING = {w.name: w for w in ROWS}
CONFIG = load_config(ROOT / "configs" / "learner.yaml", {})


def worst_case_group(n: int, tokens: int, prompt: int) -> TrajectoryGroup:
    """A group as the codec stores it at its largest: every trajectory with per-token versions."""
    rng = np.random.default_rng(0)
    return TrajectoryGroup(
        group_id="g" * 32, prompt_id="p" * 16, prompt_ids=rng.integers(4, 100, prompt, dtype=np.int32),
        policy_version=7, actor_id="actor-12", created_at=time.time(),
        sampling=SamplingParams(temperature=1.0, max_tokens=tokens),
        trajectories=[
            Trajectory(
                response_ids=rng.integers(4, 100, tokens, dtype=np.int32),
                behavior_logprobs=rng.random(tokens).astype(np.float32) - 5,
                reward=0.5, finish_reason="length",
                versions=np.full(tokens, 7, dtype=np.int32),
            )
            for _ in range(n)
        ],
    )  # fmt: skip


def test_bytes_per_group_are_what_the_codec_writes():
    for w in ROWS[:2]:
        frame = len(encode_group(worst_case_group(w.group_size, w.response_tokens, w.prompt_tokens)))
        arrays = group_bytes(w) - GROUP_OVERHEAD
        assert arrays < frame <= group_bytes(w), (w.name, frame, group_bytes(w))


def test_the_docs_show_the_computed_table():
    assert table(CONFIG) in (ROOT / "docs" / "deploy.md").read_text()


def test_the_rows_follow_the_learners_memory_plan():
    """A bigger model needs more learner GPUs and more of everything; 70B needs more than one node."""
    sizes = [size(w, CONFIG) for w in ROWS]
    for small, big in itertools.pairwise(sizes):
        assert big.learner_gpus > small.learner_gpus and big.checkpoints_gib > small.checkpoints_gib
    assert sizes[-1].learner_gpus > 8 and sizes[-1].actor_gpus > 1


def by_name(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_the_shipped_manifests_are_the_7b_row():
    row = size(SIZING[DEFAULT], CONFIG)
    docs = kustomize("gpu")
    claims = by_name(docs, "PersistentVolumeClaim")
    assert claims["weights"]["spec"]["resources"]["requests"]["storage"] == f"{row.weights_gib}Gi"
    assert claims["checkpoints"]["spec"]["resources"]["requests"]["storage"] == f"{row.checkpoints_gib}Gi"
    (redis,) = by_name(docs, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in redis["env"]}
    assert env["REDIS_MAXMEMORY"] == f"{row.redis_maxmemory_mib}mb"
    assert redis["resources"]["limits"]["memory"] == f"{row.redis_limit_gib}Gi"
    learner = by_name(docs, "Deployment")["learner"]["spec"]["template"]["spec"]["containers"][0]
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == str(row.learner_gpus)
    assert learner["resources"]["limits"]["memory"] == f"{row.learner_pod_gib}Gi"
    # compose: the Redis default of .env.example and of the compose file
    assert read_env_file(ROOT / ".env.example")["REDIS_MAXMEMORY"] == f"{row.redis_maxmemory_mib}mb"
    redis_env = load_compose(ROOT / "docker-compose.yml")["services"]["redis"]["environment"]
    assert redis_env["REDIS_MAXMEMORY"].endswith(f":-{row.redis_maxmemory_mib}mb}}")


def test_the_multinode_jobset_is_the_70b_row():
    """4 nodes x 8 GPUs, each node's pod limit holding node 0's host plan (the leader's: the gather streamed
    into the files, DCP's pinned stager), the volumes, Redis and the actors' tensor parallelism of 70B."""
    row = size(SIZING["70B"], CONFIG)
    docs = kustomize("multinode")
    (jobset,) = (d for d in docs if d["kind"] == "JobSet")
    (rjob,) = jobset["spec"]["replicatedJobs"]
    (node,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in node["env"]}
    per_node = min(row.learner_gpus, 8)
    assert int(env["OFFPOLICY_NNODES"]) * per_node == row.learner_gpus
    assert rjob["template"]["spec"]["parallelism"] == int(env["OFFPOLICY_NNODES"])
    assert node["resources"]["limits"]["nvidia.com/gpu"] == str(per_node) == env["OFFPOLICY_NPROC_PER_NODE"]
    assert node["resources"]["limits"]["memory"] == f"{row.learner_pod_gib}Gi"
    assert row.host_gib_node + 16 <= row.learner_pod_gib  # the plan and /dev/shm fit the limit
    claims = by_name(docs, "PersistentVolumeClaim")
    assert claims["weights"]["spec"]["resources"]["requests"]["storage"] == f"{row.weights_gib}Gi"
    assert claims["checkpoints"]["spec"]["resources"]["requests"]["storage"] == f"{row.checkpoints_gib}Gi"
    sets = by_name(docs, "StatefulSet")
    (redis,) = sets["redis"]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in redis["env"]}[
        "REDIS_MAXMEMORY"
    ] == f"{row.redis_maxmemory_mib}mb"
    assert redis["resources"]["limits"]["memory"] == f"{row.redis_limit_gib}Gi"
    (actor,) = sets["actor"]["spec"]["template"]["spec"]["containers"]
    actor_env = {e["name"]: e.get("value") for e in actor["env"]}
    assert actor["resources"]["limits"]["nvidia.com/gpu"] == str(row.actor_gpus)
    assert actor_env["OFFPOLICY_ENGINE__TENSOR_PARALLEL_SIZE"] == str(row.actor_gpus)
    assert actor_env["OFFPOLICY_MODEL_PATH"] == env["OFFPOLICY_MODEL_PATH"]


def test_a_change_of_the_retention_changes_the_volumes():
    """keep_versions / keep_checkpoints of configs/learner.yaml drive the volume sizes."""
    w = SIZING[DEFAULT]
    more = CONFIG.model_copy(update={"publish": CONFIG.publish.model_copy(update={"keep_versions": 9})})
    assert size(w, more).weights_gib > size(w, CONFIG).weights_gib
