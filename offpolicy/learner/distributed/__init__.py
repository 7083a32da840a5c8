"""Everything a learner on N ranks adds: the process group and its collectives, the leader's step-boundary
commands, the data split, FSDP2 sharding and the gathered weights. One process runs none of it but the
no-op collectives (`SINGLE`)."""

from offpolicy.learner.distributed.commands import Command, LeaderChannel, broadcast_command, run_follower
from offpolicy.learner.distributed.fsdp import clip_grad_norm, decoder_layers, loss_scale, shard
from offpolicy.learner.distributed.gather import GatheredWeights
from offpolicy.learner.distributed.ranks import (
    COLLECTIVE_TIMEOUT_S,
    HEARTBEAT_S,
    SINGLE,
    Ranks,
    all_gather_bytes,
    all_reduce_sum,
    barrier,
    current,
    init_from_env,
    local_device,
    reduce_means,
)
from offpolicy.learner.distributed.split import assign_groups, shares

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "HEARTBEAT_S",
    "SINGLE",
    "Command",
    "GatheredWeights",
    "LeaderChannel",
    "Ranks",
    "all_gather_bytes",
    "all_reduce_sum",
    "assign_groups",
    "barrier",
    "broadcast_command",
    "clip_grad_norm",
    "current",
    "decoder_layers",
    "init_from_env",
    "local_device",
    "loss_scale",
    "reduce_means",
    "run_follower",
    "shard",
    "shares",
]
