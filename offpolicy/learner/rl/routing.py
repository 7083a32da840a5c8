"""Routing replay in a step (`moe.routing_replay`, model/moe.py): which expert choices the update's forwards
replay. `rollout` (R3): the rollout's (`Batch.routed_experts`), in pi_old's pass and the update alike.
`old` (R2): pi_old's pass routes freely and records its own choices (`old_pass`), the update replays them;
in bypass mode pi_old is the behaviour policy, so `old` replays the rollout's choices as `rollout` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offpolicy.learner.model import lora
from offpolicy.learner.model.moe import replay_shape
from offpolicy.learner.rl.microbatches import rows_forward

if TYPE_CHECKING:
    from offpolicy.learner.batch import Batch
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.learner.distributed.ranks import Ranks
    from offpolicy.learner.model.precision import Precision


def old_pass(
    policy: torch.nn.Module, batch: Batch, cfg: LearnerConfig, precision: Precision, ranks: Ranks
) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_old's log-probs (B, R) and its own expert choices at each response-predicting position
    (B, R, L, K) int16 (int32 past 32767 experts), -1 past each row's response: `no_grad_logprobs` with the
    policy (a `LogProbs` of an MoE model) recording. Each micro-batch's result travels as one fp32 tensor
    (b, r, 1 + L K): the log-prob, then the experts + 1 (0 = none), exact below 2^24, so that `rows_forward`
    sums the ranks' shares as it does for log-probs."""
    layers, top_k = replay_shape(policy)

    def forward(mb: Batch) -> torch.Tensor:
        lp = policy(mb, cfg.logprob_chunk_tokens, cfg.packing)[0]  # (b, r)
        routes = policy.routes + 1  # (b, r, L, K): 0 = no row
        return torch.cat([lp[..., None].float(), routes.flatten(2).float()], -1)  # (b, r, 1 + L K)

    policy.recording = True
    try:
        with precision.autocast(), lora.dropout_off(policy):
            out = rows_forward(forward, batch, cfg, ranks, (1 + layers * top_k,))  # (B, R, 1 + L K)
    finally:
        policy.recording = False
    B, R = out.shape[:2]
    routes = out[..., 1:].round().long().view(B, R, layers, top_k) - 1  # (B, R, L, K)
    P = batch.prompt_width
    real = batch.attention_mask[:, P - 1 : P - 1 + R].bool()  # (B, R): the position predicting j is real
    routes = routes.masked_fill(~real[..., None, None], -1)
    wide = int(routes.max()) > torch.iinfo(torch.int16).max
    return out[..., 0], routes.to(torch.int32 if wide else torch.int16)


def choose(ctx_cfg: LearnerConfig, batch: Batch) -> None:
    """`batch.replay_experts` before pi_old's pass: the rollout's under `rollout` (and `old` in bypass
    mode); `old` otherwise fills them from `old_pass`."""
    mode = ctx_cfg.moe.routing_replay
    if mode == "rollout" or (mode == "old" and ctx_cfg.rollout_correction.bypass_mode):
        batch.replay_experts = batch.routed_experts
