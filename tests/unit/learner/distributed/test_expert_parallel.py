"""`fsdp.expert_parallel`: the sizes that cannot work are refused naming the field and the values; the
config field itself takes positive integers only."""

from __future__ import annotations

import pydantic
import pytest

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.models import FsdpConfig
from offpolicy.learner.distributed.expert_parallel import check, check_config
from offpolicy.learner.distributed.ranks import SINGLE, Ranks
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.tiny import make_tiny_moe_model


@pytest.mark.parametrize(
    ("ep", "world", "experts", "kw", "words"),
    [
        (2, 4, 0, {}, ["fsdp.expert_parallel = 2", "dense model"]),
        (3, 4, 6, {}, ["fsdp.expert_parallel = 3", "does not divide the 4 learner ranks"]),
        (4, 4, 6, {}, ["fsdp.expert_parallel = 4", "does not divide the model's 6 routed experts"]),
        (2, 4, 8, {"replicate": 2}, ["fsdp.expert_parallel = 2", "fsdp.replicate = 2"]),
        (2, 2, 4, {"cpu_offload": True}, ["fsdp.expert_parallel = 2", "fsdp.cpu_offload"]),
        (0, 2, 4, {}, ["fsdp.expert_parallel = 0", "at least 1"]),
    ],
    ids=["dense", "world", "experts", "replicate", "offload", "zero"],
)
def test_sizes_that_cannot_work_are_refused(ep, world, experts, kw, words):
    with pytest.raises(ValueError) as info:
        check(ep, world, experts, **kw)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize(("ep", "world", "experts"), [(1, 3, 0), (1, 4, 6), (2, 2, 4), (2, 4, 8), (4, 4, 8)])
def test_sizes_that_divide_pass(ep, world, experts):
    check(ep, world, experts)  # ep = 1 is no expert parallelism: any model, any world size


def test_the_field_defaults_to_1_and_refuses_0():
    assert FsdpConfig().expert_parallel == 1
    assert FsdpConfig(expert_parallel=4).expert_parallel == 4
    with pytest.raises(pydantic.ValidationError, match="expert_parallel"):
        FsdpConfig(expert_parallel=0)


def test_the_learner_refuses_it_before_building_from_the_models_config(tmp_path):
    """`check_config` reads the experts from config.json: a dense model with EP 2 on 2 ranks is refused,
    a 4-expert MoE on 4 ranks with EP 4 passes, and one process ignores the field (as every `fsdp` one)."""
    dense = make_tiny_model(tmp_path / "dense", hidden_size=64, num_heads=1, num_layers=1)
    sparse = make_tiny_moe_model(tmp_path / "moe", num_layers=1, num_experts=4)
    fake_group = object()  # only `distributed` is read: a joined process group
    two, four = (Ranks(0, n, 0, fake_group) for n in (2, 4))  # type: ignore[arg-type]

    def cfg(path, ep):
        return LearnerConfig(model_path=str(path), fsdp={"expert_parallel": ep})

    with pytest.raises(ValueError, match=r"fsdp.expert_parallel = 2: the policy is a dense model"):
        check_config(cfg(dense, 2), two)
    with pytest.raises(ValueError, match=r"fsdp.expert_parallel = 3 does not divide the 4 learner ranks"):
        check_config(cfg(sparse, 3), four)
    check_config(cfg(sparse, 4), four)
    check_config(cfg(dense, 2), SINGLE)
