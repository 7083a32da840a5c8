"""`offpolicy learner`'s nodes and ranks: flags over OFFPOLICY_* variables, the torchrun command for one node
(standalone) and for several (c10d rendezvous), the checks, and the global rank by node rank."""

from __future__ import annotations

import sys

import pytest
import torch

from offpolicy.learner.distributed.layout import Layout, LayoutError
from offpolicy.learner.distributed.ranks import node_ordered_rank
from offpolicy.services.cli import commands as cli

NONE = dict.fromkeys(cli.LAYOUT_FLAGS)


def test_one_node_runs_torchrun_standalone():
    layout = Layout.resolve(NONE | {"nproc_per_node": 4, "max_restarts": 2}, {})
    argv = layout.torchrun_argv(["-m", "x"])
    assert argv[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=4" in argv and "--max-restarts=2" in argv and argv[-2:] == ["-m", "x"]
    assert not any(a.startswith("--rdzv") for a in argv)
    assert not Layout.resolve(NONE, {}).needs_torchrun  # one rank: the plain one-process learner


def test_several_nodes_meet_at_the_c10d_rendezvous():
    layout = Layout.resolve(
        NONE | {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "learner-0.learner:29400", "nproc_per_node": 8},
        {},
    )
    argv = layout.torchrun_argv(["-m", "x"])
    assert "--standalone" not in argv
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=learner-0.learner:29400"} <= set(argv)
    assert "--rdzv-id=offpolicy-learner" in argv and "--nproc-per-node=8" in argv
    assert layout.world_size == 16 and layout.needs_torchrun
    # what torchrun and every rank inherit: the node rank, a fresh store per rendezvous round
    assert layout.env() == {
        "OFFPOLICY_NNODES": "2",
        "OFFPOLICY_NODE_RANK": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def test_the_environment_sets_the_layout_and_a_flag_wins():
    env = {
        "OFFPOLICY_NNODES": "3",
        "OFFPOLICY_NODE_RANK": "2",
        "OFFPOLICY_RDZV_ENDPOINT": "10.0.0.1:29400",
        "OFFPOLICY_RDZV_ID": "job-7",
        "OFFPOLICY_NPROC_PER_NODE": "8",
        "OFFPOLICY_MAX_RESTARTS": "3",
        "OFFPOLICY_UNRELATED": "x",
    }
    layout = Layout.resolve(NONE, env)
    assert (layout.nnodes, layout.node_rank, layout.nproc_per_node, layout.max_restarts) == (3, 2, 8, 3)
    assert (layout.rdzv_endpoint, layout.rdzv_id) == ("10.0.0.1:29400", "job-7")
    assert Layout.resolve(NONE | {"node_rank": 0, "nproc_per_node": 2}, env).node_rank == 0
    assert Layout.resolve(NONE | {"node_rank": 0, "nproc_per_node": 2}, env).nproc_per_node == 2


@pytest.mark.parametrize(
    ("given", "env", "says"),
    [
        ({"nnodes": 2}, {}, "needs --rdzv-endpoint"),
        ({"nnodes": 2, "rdzv_endpoint": "no-port"}, {}, "is not HOST:PORT"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, {}, "--node-rank / OFFPOLICY_NODE_RANK: 2"),
        ({}, {"OFFPOLICY_NPROC_PER_NODE": "eight"}, "is not an integer"),
        ({"nproc_per_node": 0}, {}, "at least 1"),
        ({"max_restarts": -1}, {}, "at least 0"),
        ({"rdzv_id": "a b"}, {}, "--rdzv-id"),
    ],
)
def test_a_layout_that_cannot_work_is_refused_naming_flag_and_variable(given, env, says):
    with pytest.raises(LayoutError, match=says):
        Layout.resolve(NONE | given, env)


def test_the_cli_refuses_a_bad_layout_before_starting_anything(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(cli.os, "execv", lambda *a: pytest.fail("torchrun started"))
    args = cli.build_parser().parse_args(["learner", "--nnodes", "2", "--nproc-per-node", "1"])
    assert args.func(args) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err


def test_the_cli_execs_torchrun_with_the_rendezvous_from_the_environment(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: seen.update(argv=argv))
    for var, value in {
        "OFFPOLICY_NNODES": "2",
        "OFFPOLICY_NODE_RANK": "1",
        "OFFPOLICY_RDZV_ENDPOINT": "127.0.0.1:29555",
        "OFFPOLICY_NPROC_PER_NODE": "1",
    }.items():
        monkeypatch.setenv(var, value)
    args = cli.build_parser().parse_args(["learner", "--port", "8124"])
    assert args.func(args) == 0
    argv = seen["argv"]
    assert "--nnodes=2" in argv and "--rdzv-endpoint=127.0.0.1:29555" in argv and "--nproc-per-node=1" in argv
    assert argv[argv.index("-m", 3) + 1] == "offpolicy.services.learner_api" and argv[-2:] == [
        "--port",
        "8124",
    ]
    assert cli.os.environ["OFFPOLICY_NODE_RANK"] == "1"  # inherited by the ranks: they number by it


def test_one_node_keeps_torchrun_s_rank():
    assert node_ordered_rank({"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}) == 3
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "OFFPOLICY_NNODES": "1",
        "OFFPOLICY_NODE_RANK": "0",
    }
    assert node_ordered_rank(env) == 1
