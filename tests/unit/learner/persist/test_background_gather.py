"""The background publish gather's process group is gloo whatever the training's backend (persist/
background_gather.py: a gather over NCCL from the helper thread rode the training's default stream and
deadlocked with FSDP2's collectives on 2+ GPUs). The gather itself, on 2 gloo ranks, is
tests/integration/learner/distributed/test_gathered_weights.py; the CUDA case, tests/gpu/
test_publish_gather_cuda.py."""

from __future__ import annotations

import torch.distributed as dist

from offpolicy.learner.persist import background_gather


def test_the_publish_group_is_gloo_under_an_nccl_training(monkeypatch):
    asked = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: asked.append((ranks, kw)) or object())
    monkeypatch.setattr(background_gather, "_GROUPS", {})
    first = background_gather.publish_group([0, 1])
    assert background_gather.publish_group([0, 1]) is first  # created once per process
    assert asked == [([0, 1], {"backend": "gloo"})]
