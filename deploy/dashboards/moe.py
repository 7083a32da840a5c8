"""The correction dashboard's mixture-of-experts row: router agreement and the log-prob gap by staleness
bucket, and the router losses (offpolicy/learner/metrics.py `MOE_BY_STALENESS`)."""

from __future__ import annotations

from deploy.dashboards.panels import Panel, q

MOE_ROW = (
    "Mixture of experts (routing)",
    (
        Panel(
            "Router agreement by staleness bucket",
            (
                q(
                    "avg by (staleness) (offpolicy_learner_moe_router_agreement_by_staleness)",
                    "staleness {{staleness}}",
                ),
                q("avg(offpolicy_learner_moe_router_agreement)", "all tokens"),
            ),
            unit="percentunit",
            description="Share of token-layers whose learner top-k equals the rollout's experts "
            "(under moe.routing_replay, the replayed ones), by how many versions old the tokens "
            "were: "
            "the router's drift from the behaviour policy's choices as data ages.",
        ),
        Panel(
            "Log-prob gap |log pi - log mu| by staleness bucket",
            (
                q(
                    "avg by (staleness) (offpolicy_learner_moe_logprob_gap_by_staleness)",
                    "staleness {{staleness}}",
                ),
                q("avg(offpolicy_learner_moe_logprob_gap)", "all tokens"),
            ),
            description="Mean absolute gap between the learner's and the engine's log-probs of the "
            "sampled tokens (MoE groups with routed experts), with or without routing replay as "
            "configured.",
        ),
        Panel(
            "Router losses",
            (
                q("avg(offpolicy_learner_moe_aux_loss)", "load balancing"),
                q("avg(offpolicy_learner_moe_z_loss)", "z-loss"),
            ),
        ),
    ),
)
