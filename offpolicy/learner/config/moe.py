"""The learner's `moe` section: the router's auxiliary losses of a mixture-of-experts policy
(learner/model/moe.py; docs/learner.md "MoE models")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from offpolicy.config.base import FROZEN, ConfigModel


class MoeConfig(ConfigModel):
    """Router losses added to the policy loss of an MoE policy (Qwen3-MoE, Qwen2-MoE, Mixtral,
    DeepSeek-V2/V3): `loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss + aux_loss_coef *
    aux_loss + z_loss_coef * z_loss`, each router loss computed over every token (prompt and response) of
    a micro-batch and weighted by the micro-batch's share of the mini-batch's tokens. Both are
    reported as `moe/aux_loss` and `moe/z_loss` whatever their coefficients. Both default to 0, as verl:
    its Megatron configs set `moe_router_load_balancing_type: none` ("turn off aux_loss as it hurts perf
    in RL") and Megatron's z-loss is off unless set; its FSDP actor never adds transformers' `aux_loss`.
    A dense policy with a coefficient above 0 is refused at start."""

    aux_loss_coef: float = Field(0.0, ge=0.0)
    """Weight of the load-balancing loss (Switch Transformer: E x sum_e f_e P_e over all layers' tokens,
    transformers' `load_balancing_loss_func`; top_k when the routing is uniform). 0 = not added; the models'
    own `router_aux_loss_coef` (e.g. 0.001 for Qwen3-MoE) is a pretraining value and is not read."""
    z_loss_coef: float = Field(0.0, ge=0.0)
    """Weight of the router z-loss (ST-MoE: mean over layers and tokens of logsumexp(router logits)^2,
    which keeps the router logits small); 0 = not added. ST-MoE used 1e-3."""

    routing_replay: Literal["off", "rollout", "old"] = Field("off", json_schema_extra=FROZEN)
    """Which expert choices the update's forward uses (docs/learner.md "MoE models", model/moe.py
    `Routes`): `off` = the learner's own top-k; `rollout` (R3) = the experts the rollout engine chose for
    each response-predicting position (the record's `routed_experts`), in pi_old and the update alike,
    with gate weights from the learner's own router logits at those experts (softmax, renormalized as the
    model does), so the router still learns; a group without routed experts is then refused by name
    (`dropped:invalid:trajectories.routed_experts`), never trained unreplayed; `old` (R2) = pi_old's pass
    routes freely and records its choices, the update replays them. Prompt positions route freely.
    Refused for a dense policy; Qwen3-MoE, Qwen2-MoE and Mixtral routers (softmax top-k) only. Frozen
    while running (the intake's refusal of unrouted groups is set at start)."""

    @property
    def on(self) -> bool:
        """Whether any router loss is added to the policy loss."""
        return self.aux_loss_coef > 0 or self.z_loss_coef > 0
