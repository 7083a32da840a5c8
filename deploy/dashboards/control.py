"""The Overview dashboard's off-policyness control row: the staleness bound in force and whether `auto`
sets it, its changes by reason, the learner's wait for data and the actor capacity it asks for
(offpolicy/learner/control/)."""

from __future__ import annotations

from deploy.dashboards.panels import RATE, Panel, q

CONTROL_ROW = (
    "Off-policyness control",
    (
        Panel(
            "Staleness bound in force",
            (
                q("max by (run_id) (offpolicy_learner_max_staleness_steps)", "bound {{run_id}}"),
                q("max by (run_id) (offpolicy_learner_control_auto)", "auto {{run_id}}"),
            ),
            width=6,
            description="buffer.max_staleness as given, or the controller's under `control.mode: "
            "auto` (`auto` 1); GET /v1/status `control` and /v1/config/history `control` say why it "
            "moved.",
        ),
        Panel(
            "Bound changes by reason",
            (
                q(
                    f"sum by (reason) (increase(offpolicy_learner_control_changes_total[{RATE}]))",
                    "{{reason}}",
                ),
            ),
            width=6,
            description="The controller's changes: ess_below_floor and masked_above_ceiling halve "
            "the bound, learner_waiting doubles it (learner/control/).",
        ),
        Panel(
            "Learner wait for data",
            (q("max by (run_id) (offpolicy_learner_wait_share)", "{{run_id}}"),),
            unit="percentunit",
            width=6,
            description="Share of the learner's time spent waiting for groups over the controller's "
            "last window; above control.wait_ceiling the bound rises and more actors are asked for.",
        ),
        Panel(
            "Actor capacity wanted",
            (q("max by (run_id) (offpolicy_learner_actor_capacity_ratio)", "{{run_id}}"),),
            width=6,
            description="The actors the learner wants over those it has (1 = enough): the k8s gpu "
            "overlay's HPA multiplies the actor StatefulSet by it; with compose, scale by hand.",
        ),
    ),
)
