"""k8s/ network policies: behind the namespace's default deny, only the learner and the actors reach Redis,
they reach each other for the weight transfer, and agent clients reach the actors' gateway, nothing else."""

from __future__ import annotations

import pytest
import yaml

from deploy.checks import ROOT
from tests.unit.deploy.test_k8s import OVERLAYS, admits, by_kind, pod_specs


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_only_learner_and_actors_reach_redis(overlay):
    policies = by_kind(overlay, "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    (rule,) = policies["redis-from-learner-and-actors"]["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/name", "operator": "In", "values": ["learner", "actor"]}
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_learner_and_actors_reach_each_other_for_the_weight_transfer(overlay):
    """The rendezvous store on `publish.transfer.port`, NCCL's ring on ephemeral ports: learner -> actor,
    actor -> learner and actor -> actor must get through the namespace's default deny."""
    policies = by_kind(overlay, "NetworkPolicy").values()
    learner, actor = {"app.kubernetes.io/name": "learner"}, {"app.kubernetes.io/name": "actor"}
    redis = {"app.kubernetes.io/name": "redis"}
    store_port = yaml.safe_load((ROOT / "configs/learner.yaml").read_text())["publish"]["transfer"]["port"]
    assert store_port != 0  # a fixed port, documented and declared by the learner's container
    learner_spec = pod_specs(overlay)["learner"]["containers"][0]
    assert {"name": "transfer", "containerPort": store_port} in learner_spec["ports"]
    for source, target, port in [
        (actor, learner, store_port),
        (actor, learner, 45123),  # NCCL's ephemeral ports
        (learner, actor, 45123),
        (actor, actor, 45123),
    ]:
        assert any(admits(p, source, target, port) for p in policies), (source, target, port)
    # nothing else is opened: Redis still only on 6379, and not from outside the learner and actors
    assert not any(admits(p, learner, redis, 45123) for p in policies)
    assert not any(admits(p, {"app.kubernetes.io/name": "other"}, actor, 45123) for p in policies)


def reaches(policies, source: dict, namespace: dict, target: dict, port: int) -> bool:
    """Whether a pod labelled `source` in a namespace labelled `namespace` (this one: {}) reaches a pod of
    this namespace labelled `target` on TCP `port`, through any of `policies`."""

    def matches(selector: dict, labels: dict) -> bool:
        assert not selector.get("matchExpressions") or all(
            e["operator"] == "In" for e in selector["matchExpressions"]
        )
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
            labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
        )

    here = not namespace
    for policy in policies:
        if not matches(policy["spec"]["podSelector"], target):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p.get("port") == port for p in ports):
                continue
            for peer in rule.get("from", []):
                ns, pod = peer.get("namespaceSelector"), peer.get("podSelector")
                in_ns = here if ns is None else matches(ns, namespace)
                if in_ns and (pod is None or matches(pod, source)):
                    return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_agent_clients_reach_the_gateway_with_its_own_token(overlay):
    """An agent pod of this namespace, or one labelled offpolicy.dev/gateway-client in a namespace labelled
    so, reaches an actor's gateway (8001) through its headless Service; nothing else of the stack; the
    actors hold the gateway's token (Secret key gateway-token), not the learner's admin token; the
    learner gets W&B's key from the Secret's optional key."""
    policies = by_kind(overlay, "NetworkPolicy").values()
    actor, learner = {"app.kubernetes.io/name": "actor"}, {"app.kubernetes.io/name": "learner"}
    redis = {"app.kubernetes.io/name": "redis"}
    agent = {"app": "my-agent", "offpolicy.dev/gateway-client": "true"}
    agents_ns = {"kubernetes.io/metadata.name": "agents", "offpolicy.dev/gateway-client": "true"}
    other_ns = {"kubernetes.io/metadata.name": "elsewhere"}
    assert reaches(policies, {"app": "my-agent"}, {}, actor, 8001)
    assert reaches(policies, agent, agents_ns, actor, 8001)
    assert not reaches(policies, agent, other_ns, actor, 8001)
    assert not reaches(policies, {"app": "my-agent"}, agents_ns, actor, 8001)  # the pod is labelled too
    assert not reaches(policies, agent, agents_ns, learner, 8000)
    assert not reaches(policies, agent, agents_ns, redis, 6379)
    assert not reaches(policies, {"app": "my-agent"}, {}, redis, 6379)
    (service,) = (s for s in by_kind(overlay, "Service").values() if s["spec"]["selector"] == actor)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["port"] == 8001

    def secret_keys(container: dict) -> dict[str, dict]:
        return {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for e in container["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }

    specs = pod_specs(overlay)
    actor_keys = secret_keys(specs["actor"]["containers"][0])
    assert actor_keys["OFFPOLICY_GATEWAY_TOKEN"]["key"] == "gateway-token"
    assert "OFFPOLICY_API_TOKEN" not in actor_keys
    learner_keys = secret_keys(specs["learner"]["containers"][0])
    assert learner_keys["WANDB_API_KEY"] == {"name": learner_keys["OFFPOLICY_API_TOKEN"]["name"],
                                             "key": "wandb-api-key", "optional": True}  # fmt: skip
