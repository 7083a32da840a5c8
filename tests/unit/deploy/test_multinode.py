"""k8s/overlays/multinode: the learner on N nodes x G GPUs as a JobSet. The JobSet validates against
deploy/schemas/jobset-v1alpha2.json (written from the JobSet API reference: no JobSet CRD ships in a
Python package) and its Job template against Kubernetes' own batch/v1 schema; each pod's environment
gives the launcher its node rank, the node and rank counts and one rendezvous point; one failed pod
restarts the group; only rank 0 is behind the learner Service and its ServiceMonitor."""

from __future__ import annotations

import copy
import functools
import json

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from deploy.checks import ROOT, config_maps, pod_environment
from offpolicy.learner.config import load_config as load_learner_config
from tests.unit.deploy.test_k8s import K8S_VERSION, build, build_dir, copy_sources, crd_check

SCHEMA = json.loads((ROOT / "deploy" / "schemas" / "jobset-v1alpha2.json").read_text())
OVERLAY = "multinode"
LAUNCHER_VARS = (
    "OFFPOLICY_NNODES", "OFFPOLICY_NODE_RANK", "OFFPOLICY_RDZV_ENDPOINT", "OFFPOLICY_RDZV_ID",
    "OFFPOLICY_NPROC_PER_NODE", "OFFPOLICY_MAX_RESTARTS",
)  # fmt: skip


def jobset(docs: tuple[dict, ...]) -> dict:
    (doc,) = (d for d in docs if d["kind"] == "JobSet")
    return doc


def the_job(doc: dict) -> dict:
    """The JobSet's one replicated Job (`node`): its JobTemplateSpec."""
    (rjob,) = doc["spec"]["replicatedJobs"]
    assert rjob["name"] == "node" and rjob.get("replicas", 1) == 1
    return rjob["template"]


def learner_container(doc: dict) -> dict:
    (container,) = the_job(doc)["spec"]["template"]["spec"]["containers"]
    return container


def pod_env(docs: tuple[dict, ...], rank: int) -> dict[str, str]:
    """The environment of node `rank`'s pod (the Job's completion index), as the kubelet resolves it."""
    doc = jobset(docs)
    name = f"{doc['metadata']['name']}-node-0-{rank}-abcde"
    return pod_environment(learner_container(doc), name, rank, config_maps(list(docs)))


def validate_jobset(doc: dict) -> None:
    jsonschema.validate(doc, SCHEMA)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "node"},
        "spec": the_job(doc)["spec"],
    }
    kv.validate(job, K8S_VERSION, strict=True)


@functools.cache
def docs() -> tuple[dict, ...]:
    return build(OVERLAY)


def test_every_manifest_validates_the_jobset_against_its_schema():
    kinds = set()
    for doc in docs():
        kinds.add(doc["kind"])
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "offpolicy", doc["metadata"][
            "name"
        ]
        if doc["kind"] == "JobSet":
            validate_jobset(doc)
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            crd_check(doc)
        else:
            kv.validate(doc, K8S_VERSION, strict=True)
    assert "JobSet" in kinds and "Deployment" not in kinds, "the JobSet replaces the one-pod learner"


@pytest.mark.parametrize(
    ("path", "value"),
    [(("spec", "failurePolicy", "maxRestart"), 3),  # misspelt
     (("spec", "failurePolicy", "restartStrategy"), "RestartAll"),
     (("spec", "network", "enableDNSHostname"), True)],
)  # fmt: skip
def test_the_schema_catches_a_wrong_jobset_field(path, value):
    doc = copy.deepcopy(jobset(docs()))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)


def test_a_wrong_pod_field_is_caught_by_the_kubernetes_schema():
    doc = copy.deepcopy(jobset(docs()))
    learner_container(doc)["resource"] = {}  # misspelt `resources`
    with pytest.raises(kv.ValidationError):
        validate_jobset(doc)


def test_each_pod_gets_its_node_rank_and_one_rendezvous_point():
    built = docs()
    doc, job = jobset(built), the_job(jobset(built))
    nodes = job["spec"]["parallelism"]
    assert nodes == job["spec"]["completions"] >= 2 and job["spec"]["completionMode"] == "Indexed"
    container = learner_container(doc)
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    # the run id of the one ConfigMap, the same in every pod
    (run,) = (
        d for d in built if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("offpolicy-run")
    )
    subdomain = doc["spec"]["network"]["subdomain"]
    (headless,) = (d for d in built if d["kind"] == "Service" and d["metadata"]["name"] == subdomain)
    envs = [pod_env(built, rank) for rank in range(nodes)]
    for rank, env in enumerate(envs):
        assert set(LAUNCHER_VARS) <= set(env), rank
        assert env["OFFPOLICY_NODE_RANK"] == str(rank)
        assert env["OFFPOLICY_NNODES"] == str(nodes) and env["OFFPOLICY_NPROC_PER_NODE"] == gpus
        assert env["OFFPOLICY_RDZV_ID"] == run["data"]["run-id"]
        assert int(env["OFFPOLICY_MAX_RESTARTS"]) >= 0
    assert len({e["OFFPOLICY_RDZV_ENDPOINT"] for e in envs}) == 1, "every node meets at one point"
    host, port = envs[0]["OFFPOLICY_RDZV_ENDPOINT"].rsplit(":", 1)
    # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>: the pod of node rank 0
    assert host == f"{doc['metadata']['name']}-node-0-0.{subdomain}"
    assert doc["spec"]["network"]["enableDNSHostnames"] is True
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": doc["metadata"]["name"]}
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["rdzv"] == int(port)
    assert [p["port"] for p in headless["spec"]["ports"]] == [int(port)]


def test_every_pod_loads_a_valid_learner_config_with_per_run_folders():
    for rank in (0, 1):
        cfg = load_learner_config(ROOT / "configs" / "learner.yaml", pod_env(docs(), rank))
        assert str(cfg.weights_path) == f"/var/lib/offpolicy/weights/{cfg.run_id}"
        assert str(cfg.checkpoint_path) == f"/var/lib/offpolicy/checkpoints/{cfg.run_id}"


def test_references_to_generated_objects_and_image_tags_reach_the_jobset():
    """kustomize knows no JobSet: kustomizeconfig.yaml teaches it the hashed ConfigMap names and images."""
    built = docs()
    maps = {d["metadata"]["name"] for d in built if d["kind"] == "ConfigMap"}
    spec = the_job(jobset(built))["spec"]["template"]["spec"]
    container = learner_container(jobset(built))
    refs = {
        e["valueFrom"]["configMapKeyRef"]["name"]
        for e in container["env"]
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    refs |= {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
    assert refs and refs <= maps, refs - maps
    (actor,) = (d for d in built if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "actor")
    tag = actor["spec"]["template"]["spec"]["containers"][0]["image"].rsplit(":", 1)[1]
    assert container["image"] == f"offpolicy/learner:{tag}"


def test_one_failed_pod_restarts_the_whole_group():
    doc = jobset(docs())
    policy = doc["spec"]["failurePolicy"]
    assert policy["restartStrategy"] == "Recreate" and policy["maxRestarts"] >= 1
    job = the_job(doc)["spec"]
    assert job["backoffLimit"] == 0, "a retried pod would rejoin a group that went on without it"
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    pod = job["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert learner_container(doc)["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_shared_memory_and_shared_claims():
    built = docs()
    spec = the_job(jobset(built))["spec"]["template"]["spec"]
    container = learner_container(jobset(built))
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    claims = {d["metadata"]["name"]: d for d in built if d["kind"] == "PersistentVolumeClaim"}
    for path in ("weights", "checkpoints", "logs"):
        claim = volumes[mounts[f"/var/lib/offpolicy/{path}"]["name"]]["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], f"{path}: every node mounts it"
    for path in ("/var/lib/offpolicy/models", "/opt/offpolicy/code"):
        assert mounts[path]["readOnly"] is True, path
    assert {e["name"]: e.get("value") for e in container["env"]}["PYTHONPATH"] == "/opt/offpolicy/code"


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_learner_service_and_its_monitor_select_rank_0_only():
    built = docs()
    doc = jobset(built)
    template_labels = the_job(doc)["spec"]["template"]["metadata"]["labels"]
    pods = [  # the labels the JobSet and Job controllers put on each node's pod
        template_labels | {"jobset.sigs.k8s.io/jobset-name": doc["metadata"]["name"],
                           "jobset.sigs.k8s.io/replicatedjob-name": "node",
                           "jobset.sigs.k8s.io/job-index": "0",
                           "batch.kubernetes.io/job-completion-index": str(rank)}
        for rank in range(the_job(doc)["spec"]["parallelism"])
    ]  # fmt: skip
    services = {d["metadata"]["name"]: d for d in built if d["kind"] == "Service"}
    picked = [
        rank for rank, labels in enumerate(pods) if selects(services["learner"]["spec"]["selector"], labels)
    ]
    assert picked == [0]
    # the ServiceMonitor scrapes the learner Service (rank 0), not the rendezvous Service (every pod)
    (monitor,) = (d for d in built if d["kind"] == "ServiceMonitor")
    (expr,) = monitor["spec"]["selector"]["matchExpressions"]
    names = {n: s["metadata"]["labels"].get(expr["key"]) for n, s in services.items()}
    assert names["learner"] in expr["values"] and names["learner-nodes"] not in expr["values"]
    # the learner pods reach each other on any port (rendezvous, NCCL); the namespace denies otherwise
    (group,) = (d for d in built if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "learner-group")
    (rule,) = group["spec"]["ingress"]
    assert "ports" not in rule and all(selects(group["spec"]["podSelector"]["matchLabels"], p) for p in pods)


def test_node_and_gpu_counts_each_change_in_one_place(tmp_path):
    """OFFPOLICY_NNODES and the GPU limit: kustomize's replacements carry them to the Job's pod count,
    the GPU request and the ranks per node."""
    copy_sources(tmp_path)
    path = tmp_path / "k8s" / "overlays" / OVERLAY / "learner-jobset.yaml"
    text = path.read_text()
    nodes_line = 'name: OFFPOLICY_NNODES\n                      value: "4"'
    head, limits, tail = text.partition("limits:")
    assert nodes_line in head and 'nvidia.com/gpu: "8"' in tail
    text = head.replace(nodes_line, nodes_line.replace('"4"', '"6"')) + limits
    path.write_text(text + tail.replace('nvidia.com/gpu: "8"', 'nvidia.com/gpu: "4"', 1))
    built = build_dir(tmp_path / "k8s" / "overlays" / OVERLAY)
    job = the_job(jobset(built))["spec"]
    assert job["parallelism"] == job["completions"] == 6
    env = pod_env(built, 5)
    assert env["OFFPOLICY_NNODES"] == "6" and env["OFFPOLICY_NODE_RANK"] == "5"
    assert env["OFFPOLICY_NPROC_PER_NODE"] == "4"
    assert learner_container(jobset(built))["resources"]["requests"]["nvidia.com/gpu"] == "4"
    validate_jobset(jobset(built))


def test_the_schema_file_is_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert yaml.safe_load((ROOT / "k8s" / "overlays" / OVERLAY / "kustomization.yaml").read_text())


def test_the_learner_pods_are_ready_for_nccl_across_nodes():
    """IPC_LOCK (RDMA pins NCCL's buffers), a memory-backed /dev/shm (NCCL's shared-memory transport within
    a node), NCCL on the pod's interface; everything else still dropped."""
    built = build_dir(ROOT / "k8s" / "overlays" / OVERLAY)
    pod = the_job(jobset(built))["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def with_component(tmp_path, base: str, component: str) -> tuple[list[dict], dict[str, dict]]:
    """The overlay `base` with `k8s/components/<component>` added, built; and its learner and actor
    containers by name (the JobSet's learner, or gpu's one pod)."""
    copy_sources(tmp_path)
    overlay = tmp_path / "k8s" / "overlays" / f"with-{component}"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"../{base}"],
                "components": [f"../../components/{component}"],
            }
        )
    )
    built = build_dir(overlay)
    pods = {}
    for doc in built:
        if doc["kind"] == "JobSet":
            pods["learner"] = learner_container(doc)
        elif doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] in ("learner", "actor"):
            pods[doc["metadata"]["name"]] = doc["spec"]["template"]["spec"]["containers"][0]
    assert set(pods) == {"learner", "actor"}
    return built, pods


@pytest.mark.parametrize(
    "base", ["multinode", "gpu"], ids=["on-multinode", "on-one-pod"]
)  # not "gpu": a mark
def test_the_rdma_component_gives_the_learner_and_the_actors_their_rdma_device(tmp_path, base):
    """k8s/components/rdma, added to an overlay: the RDMA device plugin's resource on every learner pod (the
    JobSet's, or gpu's one pod) and on the actors (the weight transfer), requested and limited."""
    built, pods = with_component(tmp_path, base, "rdma")
    for name, container in pods.items():
        for part in ("requests", "limits"):
            assert container["resources"][part]["rdma/hca_shared_devices_a"] == "1", (name, part)
    if base == "multinode":
        validate_jobset(jobset(built))
    plain = build_dir(ROOT / "k8s" / "overlays" / base)  # without the component: no device asked
    assert "rdma/" not in json.dumps(plain)


@pytest.mark.parametrize("base", ["multinode", "gpu"], ids=["on-multinode", "on-one-pod"])
def test_the_efa_component_gives_every_nccl_pod_its_efa_devices_and_the_plugin(tmp_path, base):
    """k8s/components/efa: the EFA device plugin's resource and the hugepages libfabric uses on every learner
    pod and on the actors, NCCL_NET_PLUGIN=ofi (the images' aws-ofi-nccl, under LD_LIBRARY_PATH when built
    with EFA_INSTALLER_VERSION) and libfabric's EFA provider; what the learner's start-up log and
    `offpolicy_learner_nccl_net_info` then say of the network."""
    from offpolicy.learner.distributed.nccl_net import network

    built, pods = with_component(tmp_path, base, "efa")
    for name, container in pods.items():
        for part in ("requests", "limits"):
            assert container["resources"][part]["vpc.amazonaws.com/efa"] == "32", (name, part)
            assert container["resources"][part]["hugepages-2Mi"] == "5120Mi", (name, part)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NCCL_NET_PLUGIN"] == "ofi" and env["FI_PROVIDER"] == "efa", name
        assert network(env, tmp_path / "no-infiniband").net == "plugin:ofi"
    if base == "multinode":
        validate_jobset(jobset(built))
    plain = build_dir(ROOT / "k8s" / "overlays" / base)
    assert "vpc.amazonaws.com/efa" not in json.dumps(plain) and "NCCL_NET_PLUGIN" not in json.dumps(plain)


@pytest.mark.parametrize("name", ["learner.Dockerfile", "actor.Dockerfile"])
def test_the_gpu_images_install_efa_and_its_nccl_plugin_only_when_asked(name):
    """EFA_INSTALLER_VERSION (empty by default; `make images` passes it): AWS's installer without the kernel
    module, and the plugin's and libfabric's folders on LD_LIBRARY_PATH, where NCCL_NET_PLUGIN=ofi finds
    libnccl-net-ofi.so."""
    text = (ROOT / "deploy" / "docker" / name).read_text()
    gpu = text[text.index("AS gpu") :]
    assert 'ARG EFA_INSTALLER_VERSION=""' in gpu
    assert 'if [ -n "${EFA_INSTALLER_VERSION}" ]' in gpu
    assert "efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify" in gpu
    assert "ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:" in gpu
    make = (ROOT / "Makefile").read_text()
    assert make.count('--build-arg EFA_INSTALLER_VERSION="$(EFA_INSTALLER_VERSION)"') == 2
