"""k8s/: each overlay built with kustomize validates (kubernetes-validate, strict; CRDs via their models);
who reaches whom through its network policies is test_k8s_network.py."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

from deploy.checks import ALERTS_FILE, ROOT, declared_metric_names, nproc_per_node

OVERLAYS = ("dev", "gpu", "lora-pool")
K8S_VERSION = kv.latest_version()  # the newest Kubernetes the installed kubernetes-validate knows


@functools.cache
def build(overlay: str) -> tuple[dict, ...]:
    """`kubectl kustomize` (kustomize v5, built into kubectl) of one overlay, as parsed documents."""
    return build_dir(ROOT / "k8s" / "overlays" / overlay)


def build_dir(folder: Path) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl (with its built-in kustomize) is needed: apt-get install kubectl")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def copy_sources(dest: Path) -> None:
    """k8s/ and the folders whose files its ConfigMaps are generated from, as the repository lays them out."""
    for folder in ("k8s", "configs", "deploy/redis", "deploy/grafana/dashboards"):
        shutil.copytree(ROOT / folder, dest / folder)


def by_kind(overlay: str, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in build(overlay) if d["kind"] == kind}


def assert_kept(written: object, parsed: object, path: str) -> None:
    """Every field written survives parsing unchanged (the model adds defaults, drops unknown fields)."""
    if isinstance(written, dict):
        assert isinstance(parsed, dict), path
        for key, value in written.items():
            assert key in parsed, f"{path}.{key}: not a field of the CRD"
            assert_kept(value, parsed[key], f"{path}.{key}")
    elif isinstance(written, list):
        assert isinstance(parsed, list) and len(parsed) == len(written), path
        for i, (w, p) in enumerate(zip(written, parsed, strict=True)):
            assert_kept(w, p, f"{path}[{i}]")
    else:
        assert written == parsed, f"{path}: {written!r} read as {parsed!r}"


def crd_check(doc: dict) -> None:
    """Prometheus-operator objects: parse with the models generated from the CRDs (cloudcoil)."""
    from cloudcoil.models.prometheus_operator import v1

    model = {"ServiceMonitor": v1.ServiceMonitor, "PrometheusRule": v1.PrometheusRule}[doc["kind"]]
    parsed = model.model_validate(doc).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert_kept(doc, parsed, doc["kind"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_every_manifest_validates(overlay):
    kinds = set()
    for doc in build(overlay):
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            crd_check(doc)
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {err.message}")
    expected = {
        "Namespace", "StatefulSet", "Deployment", "Service", "ConfigMap", "PersistentVolumeClaim",
        "NetworkPolicy", "ServiceMonitor", "PrometheusRule",
    }  # fmt: skip
    assert expected <= kinds


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_everything_lands_in_the_namespace(overlay):
    for doc in build(overlay):
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "offpolicy", doc["metadata"]["name"]


def pod_specs(overlay: str) -> dict[str, dict]:
    out = {}
    for kind in ("Deployment", "StatefulSet"):
        for name, doc in by_kind(overlay, kind).items():
            out[name] = doc["spec"]["template"]["spec"]
    return out


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_pods_are_non_root_with_requests_limits_and_probes(overlay):
    for name, spec in pod_specs(overlay).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in spec["containers"] + spec.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"], name
            assert container["resources"]["requests"]["memory"], name
            assert container["resources"]["limits"]["memory"], name
        main = spec["containers"][0]
        assert "readinessProbe" in main and "livenessProbe" in main, name


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_learner_and_actor_probes_and_seeds_from_ordinal(overlay):
    learner = by_kind(overlay, "Deployment")["learner"]
    assert learner["spec"]["replicas"] == 1 and learner["spec"]["strategy"]["type"] == "Recreate"
    container = learner["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in learner["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}  # fmt: skip
    assert {"weights", "checkpoints", "logs", "hf-cache"} <= claims
    actor = by_kind(overlay, "StatefulSet")["actor"]
    env = {e["name"]: e for e in actor["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OFFPOLICY_ACTOR_INDEX"]["value"] == "0" and env["OFFPOLICY_NUM_ACTORS"]["value"] == "1"
    # the index is the pod's ordinal (the entry point derives seeds and id from it), never a DNS name
    ref = env["OFFPOLICY_REPLICA_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert ref == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert not {"OFFPOLICY_DATASET__SEED", "OFFPOLICY_ENGINE__SEED", "OFFPOLICY_ACTOR_ID"} & set(env)


def test_gpu_overlay_requests_gpus_and_scales_actors():
    specs = pod_specs("gpu")
    assert specs["learner"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"  # the 7B row
    resources = specs["actor"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "1"
    assert by_kind("gpu", "StatefulSet")["actor"]["spec"]["replicas"] == 4
    hpa = build("gpu")[[d["kind"] for d in build("gpu")].index("HorizontalPodAutoscaler")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "actor"}
    (metric,) = hpa["spec"]["metrics"]  # the learner's capacity ratio as the factor itself (Value 1)
    assert metric["object"]["metric"]["name"] == "offpolicy_learner_actor_capacity_ratio"
    assert metric["object"]["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "learner"}
    assert metric["object"]["target"] == {"type": "Value", "value": "1"}
    # prometheus-adapter's one rule serves that name from the learner's gauge of the same name
    values = yaml.safe_load((ROOT / "deploy/prometheus/adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == metric["object"]["metric"]["name"]
    assert rule["seriesQuery"].startswith("offpolicy_learner_actor_capacity_ratio{")
    assert rule["resources"]["overrides"]["service"] == {"resource": "service"}
    assert "offpolicy_learner_actor_capacity_ratio" in declared_metric_names()
    assert not any(d["kind"] == "Secret" for d in build("gpu")), "gpu secrets are created out of band"


def learner_container(docs: tuple[dict, ...]) -> tuple[dict, dict]:
    """(the learner's pod spec, its learner container) in a build."""
    (deployment,) = (d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "learner")
    spec = deployment["spec"]["template"]["spec"]
    return spec, next(c for c in spec["containers"] if c["name"] == "learner")


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    suffix = quantity[-2:]
    return int(quantity[:-2]) * units[suffix] if suffix in units else int(quantity)


def assert_one_rank_per_gpu(docs: tuple[dict, ...]) -> int:
    """The learner's GPU request, limit and `--nproc-per-node` agree; its /dev/shm is memory. Returns N."""
    spec, container = learner_container(docs)
    resources = container["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert resources["requests"]["nvidia.com/gpu"] == gpus
    assert container["args"][:3] == ["learner", "--config", "/etc/offpolicy/learner.yaml"]
    assert nproc_per_node(container["args"]) == int(gpus), f"{container['args']} on {gpus} GPUs"
    (shm,) = (m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    (volume,) = (v for v in spec["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
    assert 2**30 <= size < quantity_bytes(resources["limits"]["memory"]), "shm counts against the limit"
    return int(gpus)


def test_gpu_learner_runs_one_rank_per_gpu_with_shared_memory():
    assert assert_one_rank_per_gpu(build("gpu")) == 2


def test_gpu_learner_rank_count_follows_its_gpu_limit(tmp_path):
    """Change only the GPU limit: kustomize's replacements carry it to the request and `--nproc-per-node`."""
    copy_sources(tmp_path)
    patch = tmp_path / "k8s" / "overlays" / "gpu" / "learner-gpu.yaml"
    head, limits, tail = patch.read_text().partition("limits:")
    assert 'nvidia.com/gpu: "2"' in tail
    patch.write_text(head + limits + tail.replace('nvidia.com/gpu: "2"', 'nvidia.com/gpu: "4"', 1))
    assert assert_one_rank_per_gpu(build_dir(tmp_path / "k8s" / "overlays" / "gpu")) == 4


def test_a_learner_whose_ranks_differ_from_its_gpus_is_caught():
    docs = tuple(yaml.safe_load(yaml.safe_dump(d)) for d in build("gpu"))  # a deep copy
    _, container = learner_container(docs)
    container["args"][-1] = "1"
    with pytest.raises(AssertionError):
        assert_one_rank_per_gpu(docs)


def test_dev_overlay_runs_the_tiny_model_on_cpu_with_a_generated_secret():
    specs = pod_specs("dev")
    for name in ("learner", "actor"):
        assert "nvidia.com/gpu" not in specs[name]["containers"][0]["resources"].get("limits", {})
        assert specs[name]["initContainers"][0]["args"][0] == "make-tiny-model"
    # one learner process: no torchrun ranks on the CPU overlay
    assert nproc_per_node(specs["learner"]["containers"][0]["args"]) in (None, 1)
    (secret,) = by_kind("dev", "Secret").values()
    assert set(secret["data"]) == {"redis-password", "api-token", "gateway-token"}
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for spec in specs.values()
            for e in spec["containers"][0]["env"] if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
    assert refs == {secret["metadata"]["name"]}


def test_configmaps_hold_the_same_configs_dashboards_and_rules():
    maps = {name.rsplit("-", 1)[0]: doc for name, doc in by_kind("dev", "ConfigMap").items()}
    assert maps["learner-config"]["data"]["learner.yaml"] == (ROOT / "configs/learner.yaml").read_text()
    assert maps["actor-config"]["data"]["actor.yaml"] == (ROOT / "configs/actor.yaml").read_text()
    assert maps["redis-config"]["data"]["redis.conf"] == (ROOT / "deploy/redis/redis.conf").read_text()
    dashboards = maps["grafana-dashboards-offpolicy"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    for file, text in dashboards["data"].items():
        assert text == (ROOT / "deploy/grafana/dashboards" / file).read_text()
    (rule,) = by_kind("dev", "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load(ALERTS_FILE.read_text())


# --- your model, your code and the Hugging Face cache; one folder per run


def container_of(overlay: str, name: str) -> tuple[dict, dict]:
    """(pod spec, main container) of the learner Deployment or the actor StatefulSet."""
    doc = {**by_kind(overlay, "Deployment"), **by_kind(overlay, "StatefulSet")}[name]
    spec = doc["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def volume_at(spec: dict, container: dict, path: str) -> tuple[dict, dict]:
    """(the mount at `path`, the pod volume it names)."""
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == path)
    (volume,) = (v for v in spec["volumes"] if v["name"] == mount["name"])
    return mount, volume


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_learner_and_actors_mount_the_model_and_the_code_read_only_and_cache_on_a_claim(overlay):
    for name in ("learner", "actor"):
        spec, container = container_of(overlay, name)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PYTHONPATH"] == "/opt/offpolicy/code", name
        for path in ("/var/lib/offpolicy/models", "/opt/offpolicy/code"):
            mount, volume = volume_at(spec, container, path)
            assert mount["readOnly"] is True, (name, path)
            if overlay == "gpu":  # the dev overlay fills them in the pod (tiny model, no code)
                assert volume["persistentVolumeClaim"]["readOnly"] is True, (name, path)
        assert env["HF_HOME"] == "/var/lib/offpolicy/hf-cache", name
        _, cache = volume_at(spec, container, "/var/lib/offpolicy/hf-cache")
        assert cache["persistentVolumeClaim"]["claimName"] == "hf-cache", f"{name}: HF cache in an emptyDir"
    claims = by_kind(overlay, "PersistentVolumeClaim")
    assert "hf-cache" in claims
    if overlay == "gpu":
        for claim in ("models", "code", "hf-cache", "weights"):
            assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], claim


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")
def test_weights_and_checkpoints_are_a_folder_per_run(overlay):
    _, container = container_of(overlay, "learner")
    env = {e["name"]: e for e in container["env"]}
    assert env["OFFPOLICY_PUBLISH__WEIGHTS_DIR"]["value"] == "/var/lib/offpolicy/weights/{run_id}"
    assert env["OFFPOLICY_CHECKPOINT__CHECKPOINT_DIR"]["value"] == "/var/lib/offpolicy/checkpoints/{run_id}"
    (run,) = (n for n in by_kind(overlay, "ConfigMap") if n.startswith("offpolicy-run-"))
    for name in ("learner", "actor"):
        _, c = container_of(overlay, name)
        (var,) = (e for e in c["env"] if e["name"] == "OFFPOLICY_RUN_ID")
        assert var["valueFrom"]["configMapKeyRef"] == {"name": run, "key": "run-id"}, name


def test_configs_come_from_the_files_themselves_without_copies():
    """No copy under k8s/ to refresh: the ConfigMaps are generated from configs/, deploy/redis/ and the
    dashboards folder, so an edit of a file changes the built ConfigMap with nothing else run."""
    assert not (ROOT / "k8s" / "base" / "files").exists()
    copies = [
        p for p in (ROOT / "k8s").rglob("*") if p.suffix in (".json", ".conf") or p.name == "learner.yaml"
    ]
    assert copies == []


def test_an_edited_config_file_reaches_the_built_configmap(tmp_path):
    copy_sources(tmp_path)
    learner = tmp_path / "configs" / "learner.yaml"
    learner.write_text(learner.read_text().replace("checkpoint_every: 10", "checkpoint_every: 7"))
    docs = build_dir(tmp_path / "k8s" / "overlays" / "gpu")
    (cm,) = (
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("learner-config")
    )
    assert "checkpoint_every: 7" in cm["data"]["learner.yaml"]
    assert cm["metadata"]["name"] != by_kind_name("gpu", "learner-config"), "a new hash rolls the pods"


def by_kind_name(overlay: str, prefix: str) -> str:
    (name,) = (n for n in by_kind(overlay, "ConfigMap") if n.startswith(prefix + "-"))
    return name


def admits(policy: dict, source: dict, target: dict, port: int) -> bool:
    """Whether `policy` lets a pod labelled `source` reach a pod labelled `target` on TCP `port` (also
    test_k8s_network.py's and test_lora_pool.py's)."""

    def matches(selector: dict, labels: dict) -> bool:
        ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
        for e in selector.get("matchExpressions", []):
            assert e["operator"] == "In", e
            ok = ok and labels.get(e["key"]) in e["values"]
        return ok

    if not matches(policy["spec"]["podSelector"], target):
        return False
    for rule in policy["spec"].get("ingress", []):
        peers = [p for p in rule.get("from", []) if "podSelector" in p and "namespaceSelector" not in p]
        ports = rule.get("ports")
        if any(matches(p["podSelector"], source) for p in peers) and (
            ports is None
            or any(p.get("port") == port or p.get("port") <= port <= p.get("endPort", -1) for p in ports)
        ):
            return True
    return False


def test_gpu_pods_may_pin_memory_for_rdma_and_keep_everything_else_dropped():
    """NCCL over InfiniBand / RoCE registers its buffers (IPC_LOCK); nothing else is added back."""
    for name, spec in pod_specs("gpu").items():
        if name not in ("learner", "actor"):
            continue
        ctx = spec["containers"][0]["securityContext"]
        assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}, name
        assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory" and quantity_bytes(shm["emptyDir"]["sizeLimit"]) >= 2**33


def _offpolicy_containers(docs: tuple[dict, ...]) -> list[tuple[str, dict, dict]]:
    """(kind/name, pod spec, container) of every learner and actor container: Deployments, StatefulSets and
    the JobSet's replicated jobs."""
    found = []
    for doc in docs:
        templates = []
        if doc["kind"] in ("Deployment", "StatefulSet"):
            templates = [doc["spec"]["template"]]
        elif doc["kind"] == "JobSet":
            templates = [job["template"]["spec"]["template"] for job in doc["spec"]["replicatedJobs"]]
        for template in templates:
            spec = template["spec"]
            for c in spec["containers"]:
                if c["name"] in ("learner", "actor"):
                    found.append((f"{doc['kind']}/{doc['metadata']['name']}", spec, c))
    return found


@pytest.mark.parametrize(
    "overlay", (*OVERLAYS, "multinode", "qwen2.5-7b-gsm8k"), ids=lambda o: f"{o}-overlay"
)
def test_pods_read_hf_token_and_learners_have_writable_compiler_caches(overlay):
    """Every container that loads a model gets HF_TOKEN from the Secret (optional key hf-token: gated models);
    every learner has a writable HOME and Triton / inductor caches on it (the root filesystem is read-only,
    and Triton writes ~/.triton/cache while the fused head compiles)."""
    containers = _offpolicy_containers(build(overlay))
    assert {c["name"] for _, _, c in containers} == {"learner", "actor"}, [w for w, _, _ in containers]
    for where, spec, c in containers:
        env = {e["name"]: e for e in c["env"]}
        ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"].startswith("offpolicy-secrets"), where  # dev: a generated name, hashed
        assert (ref["key"], ref["optional"]) == ("hf-token", True), where
        if c["name"] != "learner":
            continue
        home = env["HOME"]["value"]
        mount, volume = volume_at(spec, c, home)
        assert "emptyDir" in volume and not mount.get("readOnly"), where
        for cache in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            assert env[cache]["value"].startswith(home + "/"), (where, cache)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, where
