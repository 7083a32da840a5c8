"""The host memory plan of a learner node: each part by hand for a 7B model on 2 x 4 ranks, the leader's
node above the others', the knobs that lower it, and the refusal against the container's limit."""

from __future__ import annotations

import pytest

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.publish import STREAM_DEPTH
from offpolicy.learner.errors import MemoryPlanError
from offpolicy.learner.plan.host import GIB, PROCESS_BYTES, check, host_plan, node_bytes

P = 7_000_000_000
BUCKET = 256 * 2**20  # publish.gather_bucket_mb's default
STREAMED = (STREAM_DEPTH + 2) * BUCKET  # the leader's part of a gather streamed into the files
VLLM = {"publish": {"transport": "vllm"}}  # a broadcast backend: the leader sends from its host memory


def cfg(**kw) -> LearnerConfig:
    return LearnerConfig(model_path="unused", **kw)


def test_each_part_of_a_rank_by_hand():
    leader = host_plan(cfg(), P, 8, distributed=True, leader=True)
    assert leader.startup == 4 * P // 8  # lean start: the rank's fp32 shards
    assert leader.checkpoint_stager == 12 * P // 8  # DCP's pinned stager: masters + two moments
    # the files transport: each rank's shards twice (one gathering, the newest waiting), the leader streams
    assert leader.publish_snapshot == 2 * 2 * P // 8 and leader.published_sets == STREAMED
    assert leader.cpu_offload == 0 and leader.reference == 0
    assert leader.total == PROCESS_BYTES + leader.steady
    other = host_plan(cfg(), P, 8, distributed=True, leader=False)
    assert other.published_sets == 0 and other.total == PROCESS_BYTES + (12 + 4) * P // 8
    # a broadcast transport: the leader keeps two full sets, each rank two snapshots (as with files)
    sends = host_plan(cfg(**VLLM), P, 8, distributed=True, leader=True)
    assert sends.publish_snapshot == 2 * 2 * P // 8 and sends.published_sets == 2 * 2 * P
    m2n = host_plan(cfg(publish={"transport": "vllm", "transfer": {"backend": "nccl_m2n"}}), P, 8, True, True)
    assert m2n.published_sets == STREAMED  # every rank sends its own shards: nothing kept
    one = host_plan(cfg(), P, 1, distributed=False, leader=True)
    assert one.published_sets == 2 * 2 * P and one.publish_snapshot == 0


def test_the_leaders_node_holds_the_published_sets_and_the_knobs_lower_it():
    both = node_bytes(cfg(**VLLM), P, 8, 4, leader_node=True)
    other = node_bytes(cfg(**VLLM), P, 8, 4, leader_node=False)
    assert both - other == 2 * 2 * P
    assert node_bytes(cfg(), P, 8, 4, True) - node_bytes(cfg(), P, 8, 4, False) == STREAMED
    no_stager = cfg(checkpoint={"async_staging": False}, **VLLM)
    # without the stager a follower's peak is its start-up read (4 B x P / 8, = its two 2 B x P / 8 snapshots)
    leader = PROCESS_BYTES + 2 * 2 * P // 8 + 2 * 2 * P
    assert node_bytes(no_stager, P, 8, 4, True) == leader + 3 * (PROCESS_BYTES + 4 * P // 8) < both
    eager = host_plan(cfg(fsdp={"lean_start": False}), P, 8, distributed=True, leader=False)
    assert eager.startup == 4 * P  # every rank reads the whole model


def test_a_node_above_the_containers_limit_is_refused_with_the_knobs():
    need = node_bytes(cfg(), P, 8, 4, True)
    assert check(cfg(), P, 8, 4, True, None) == need and check(cfg(), P, 8, 4, True, need) == need
    with pytest.raises(MemoryPlanError, match=r"checkpoint.async_staging: false") as e:
        check(cfg(), P, 8, 4, True, need - GIB)
    assert f"{need / GIB:.1f} GiB" in str(e.value)


def test_delta_versions_keep_the_last_published_version_on_the_writing_rank():
    """`publish.delta`: the leader holds the last published version in bf16 (2 B x P) to diff the next
    against, on one process and on N ranks; the other ranks and a LoRA learner hold nothing more."""
    on = {"publish": {"delta": "on"}}
    for distributed, shards in ((True, 8), (False, 1)):
        leader = host_plan(cfg(**on), P, shards, distributed=distributed, leader=True)
        plain = host_plan(cfg(), P, shards, distributed=distributed, leader=True)
        assert leader.delta_base == 2 * P and leader.total == plain.total + 2 * P
    assert host_plan(cfg(**on), P, 8, distributed=True, leader=False).delta_base == 0
    lora = cfg(**on, lora={"rank": 8})
    assert host_plan(lora, P, 8, distributed=True, leader=True, adapter_params=10**7).delta_base == 0
    # the gloo transfer engine's delta rounds keep the group's last round too; NCCL sends whole (no base)
    engine = {"transport": "vllm", "transfer": {"backend": "gloo"}}
    both = host_plan(cfg(publish=on["publish"] | engine), P, 8, distributed=True, leader=True)
    assert both.delta_base == 4 * P
    nccl = {"transport": "vllm", "transfer": {"backend": "nccl"}}
    whole = host_plan(cfg(publish=on["publish"] | nccl), P, 8, distributed=True, leader=True)
    assert whole.delta_base == 2 * P
