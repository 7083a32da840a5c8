"""The learner's rank plumbing that needs no process group: commands, the token-balanced split, metric
means over ranks, and the CLI's torchrun launch."""

from __future__ import annotations

import msgpack
import pytest
import torch

from offpolicy.learner.distributed import (
    SINGLE,
    Command,
    assign_groups,
    broadcast_command,
    reduce_means,
    shares,
)
from offpolicy.services.cli import commands as cli


def test_command_round_trips_through_msgpack_bytes():
    cmd = Command("step", [b"\x00frame-1", b"frame-2"], '{"lr": 1}', 7, checkpoint=True)
    assert Command.decode(cmd.encode()) == cmd
    assert cmd.encode()[:1] != b"\x80"  # msgpack, not a pickle stream (protocol 2+ starts with PROTO)
    assert broadcast_command(SINGLE, cmd) is cmd  # one process: no collective


def test_groups_go_whole_to_the_lightest_rank():
    counts = [100, 10, 60, 50, 40]
    split = assign_groups(counts, 2)
    assert sorted(g for part in split for g in part) == list(range(5))
    loads = [sum(counts[g] for g in part) for part in split]
    assert loads == [140, 120]  # LPT: 100+40 | 60+50+10
    assert assign_groups(counts, 2) == split  # deterministic: every rank computes the same split
    assert assign_groups([5], 3) == [[0], [], []]  # fewer groups than ranks: some ranks get none


def test_shares_never_split_a_group_and_balance_tokens():
    group_index = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    tokens = torch.tensor([10, 10, 1, 1, 1, 30, 5, 5])
    rows = torch.arange(8)
    parts = shares(rows, group_index, tokens, 2)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    for part in parts:
        for g in set(group_index[part].tolist()):
            assert set((group_index == g).nonzero().squeeze(-1).tolist()) <= set(part.tolist())
    assert [int(tokens[p].sum()) for p in parts] == [33, 30]  # groups 2, 1 | groups 0, 3
    sub = shares(torch.tensor([5, 6, 7]), group_index, tokens, 2)  # a mini-batch's rows only
    assert [p.tolist() for p in sub] == [[5], [6, 7]]


def test_metric_means_count_every_value_once():
    assert reduce_means(SINGLE, {"a": (6.0, 3), "b": (1.0, 1)}) == {"a": 2.0, "b": 1.0}


def test_metric_means_over_ranks_sum_before_dividing_and_keep_keys_of_one_rank(monkeypatch):
    from offpolicy.learner.distributed import ranks as distributed

    rank1 = msgpack.packb({"a": (2.0, 1), "b": (1.0, 1)})  # what rank 1 sends (its sums and counts)
    monkeypatch.setattr(distributed, "all_gather_bytes", lambda ranks, blob: [blob, rank1])
    two = distributed.Ranks(0, 2, 0, None)
    assert reduce_means(two, {"a": (6.0, 3)}) == {"a": 2.0, "b": 1.0}  # (6+2)/(3+1); b from rank 1 alone


def test_learner_cli_execs_torchrun_for_n_processes(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a 1-GPU machine would refuse 2 ranks
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: seen.update(exe=exe, argv=argv))
    cfg = tmp_path / "learner.yaml"
    args = cli.build_parser().parse_args(
        ["learner", "--config", str(cfg), "--port", "8123", "--nproc-per-node", "2", "--max-restarts", "1"]
    )
    assert args.func(args) == 0
    argv = seen["argv"]
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=2" in argv and "--max-restarts=1" in argv
    assert argv[argv.index("-m", 3) + 1] == "offpolicy.services.learner_api"
    assert argv[-4:] == ["--config", str(cfg), "--port", "8123"]


def test_one_process_is_the_plain_learner(monkeypatch):
    from offpolicy.services.learner_api import main as learner_main

    served = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(cli.os, "execv", lambda *a: pytest.fail("no torchrun for one process"))
    monkeypatch.setattr(learner_main, "serve", lambda **kw: served.append(kw) or 0)
    args = cli.build_parser().parse_args(["learner"])
    assert args.nproc_per_node is None and args.max_restarts is None  # not given: the environment's or 1, 0
    assert args.func(args) == 0 and len(served) == 1  # the service in this process, no torchrun


def test_the_default_group_carries_host_tensors_over_gloo_beside_nccl():
    """FSDP2's CPU offload reduces host tensors (the gradient norm) on the default group: NCCL alone
    cannot, so on CUDA the default group has gloo for the CPU and NCCL for the GPU."""
    from offpolicy.learner.distributed.ranks import backend_for

    assert backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert backend_for("cpu") == "gloo"


def test_a_rank_leaves_with_its_code_and_its_output_flushed_without_the_teardown():
    """`leave`: stdout and the logs flushed, the exit code kept, and no interpreter teardown (an `atexit`
    hook never runs: the teardown is what aborted gloo ranks)."""
    import subprocess
    import sys

    code = """
import atexit, logging, os, sys
import torch.distributed as dist
from offpolicy.learner.distributed.ranks import leave
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
atexit.register(lambda: print("teardown ran"))
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
logging.getLogger("x").info("logged before leaving")
print("printed before leaving", end="")  # no newline, no flush: leave flushes it
leave(3)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "printed before leaving"
    assert "logged before leaving" in done.stderr
