"""One actor pool serving two LoRA runs, each with its learner: configs/lora-pool/ loads with the real
loaders, docker-compose.lora-pool.yml and k8s/overlays/lora-pool validate (compose-spec here; the overlay
is in test_k8s.py's OVERLAYS), and under each deployment's environment the two learners are two runs
(their run ids, weights, checkpoints, GPUs) that the one actor pool serves, both reaching Redis and both
scraped."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.checks import (
    ROOT,
    config_maps,
    gpu_ids,
    interpolate,
    load_compose,
    load_compose_resolved,
    merge_compose,
    nproc_per_node,
    pod_environment,
    read_env_file,
    strip_tags,
)
from deploy.docker.entrypoint import set_replica_seeds
from deploy.sizing import ceil_to
from offpolicy.actors.config import ActorConfig
from offpolicy.actors.config import load_config as load_actor_config
from offpolicy.actors.config.pool import capacity_refusal
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config import load_config as load_learner_config
from offpolicy.learner.plan.host import node_bytes
from offpolicy.learner.plan.memory import GIB
from tests.unit.deploy.test_compose import BASE, env, mounts, validate
from tests.unit.deploy.test_dashboards import promtool
from tests.unit.deploy.test_k8s import admits, build, by_kind, quantity_bytes
from tests.unit.deploy.test_recipes import QWEN_7B_CONFIG

POOL = ROOT / "configs" / "lora-pool"
COMPOSE = ROOT / "docker-compose.lora-pool.yml"
OVERLAY = "lora-pool"
LEARNERS = ("learner", "learner-b")  # the service / Deployment of each run
RUN_IDS = {"lora-a", "lora-b"}
WEIGHTS_ROOT = Path("/var/lib/offpolicy/weights")
DATA = Path("/var/lib/offpolicy/data")


def pool_runs(actor: ActorConfig) -> dict[str, ActorConfig]:
    """Run id -> its config: the pool's own fields (the first run) and each entry of `runs`."""
    return {run.run_id: run for run in (actor.run_config, *actor.runs)}


def load_pool(path: Path, environ: dict[str, str]) -> ActorConfig:
    """The actor's config as the image's entry point hands it over (the replica's seeds set)."""
    environ = dict(environ)
    set_replica_seeds(environ)
    return load_actor_config(path, environ)


def check_pool(learners: dict[str, LearnerConfig], actor: ActorConfig) -> None:
    """Two LoRA learners, two runs apart (ids, folders), both served by the pool with their own Redis URL,
    base model and weights root; the engine has room for exactly their adapters."""
    runs = pool_runs(actor)
    assert {c.run_id for c in learners.values()} == set(runs) == RUN_IDS
    for name, learner in learners.items():
        run = runs[learner.run_id]
        assert learner.lora is not None and actor.engine.lora is not None, name
        assert learner.lora.rank <= actor.engine.lora.max_rank, name
        assert run.redis_url == learner.redis_url and run.redis_url.endswith("@redis:6379/0"), name
        assert run.model_path == learner.model_path == actor.model_path and run.engine == actor.engine, name
        assert learner.publish.transport == "files" and run.reload.transport == "files", name
        # the learner publishes <root>/<run id>; the pool resolves its relative records under the same root
        assert Path(run.reload.weights_root) == Path(learner.publish.weights_root) == WEIGHTS_ROOT, name
        assert learner.weights_path == WEIGHTS_ROOT / learner.run_id, name
        assert learner.checkpoint_path == Path("/var/lib/offpolicy/checkpoints") / learner.run_id, name
        assert run.buffer.model_copy(update={"max_ahead": None}) == learner.buffer, name
        assert Path(run.dataset.path).parent == DATA, name
    for folder in ("weights_path", "checkpoint_path", "metrics_jsonl"):
        assert len({getattr(c, folder) for c in learners.values()}) == 2, folder
    assert len({run.dataset.path for run in runs.values()}) == 2, "two experiments, two datasets"
    assert capacity_refusal(actor.engine, len(runs)) is None
    assert capacity_refusal(actor.engine, len(runs) + 1) is not None  # sized for these two runs


# --- the config files


def test_the_configs_load_with_the_real_loaders_and_make_two_lora_runs_on_one_pool(tmp_path):
    url = "redis://:pw@redis:6379/0"
    environ = {"OFFPOLICY_REDIS_URL": url, "OFFPOLICY_REPLICA_INDEX": "0"}
    learners = {
        name: load_learner_config(POOL / f"learner-{x}.yaml", environ)
        for name, x in zip(LEARNERS, "ab", strict=True)
    }
    actor = load_pool(POOL / "actor.yaml", environ)
    check_pool(learners, actor)
    assert actor.engine.lora.model_dump() == {
        "max_rank": 16, "max_loras": 2, "max_cpu_loras": 4, "fully_sharded": False, "files_dir": None,
    }  # fmt: skip
    assert [r.run_id for r in actor.runs] == ["lora-b"] and actor.run_id == "lora-a"
    full = load_learner_config(ROOT / "configs" / "learner.yaml").optimizer.lr
    for learner in learners.values():
        assert learner.optimizer.lr == pytest.approx(10 * full), "adapters learn at about 10x the rate"


def test_every_run_of_the_pool_reads_the_deployments_redis():
    """OFFPOLICY_REDIS_URL (it holds the password) reaches the pool's first run; the runs of `runs` name no
    Redis of their own and take the pool's, so no file holds the password."""
    assert "redis_url:" not in (POOL / "actor.yaml").read_text()
    url = 'redis://:p"a\\ss#w: rd{x}@redis:6379/0'  # YAML's and JSON's special characters
    actor = load_pool(POOL / "actor.yaml", {"OFFPOLICY_REDIS_URL": url, "OFFPOLICY_REPLICA_INDEX": "0"})
    assert {run.redis_url for run in pool_runs(actor).values()} == {url}


def test_each_lora_learner_fits_one_80_gib_gpu(tmp_path, monkeypatch, capsys):
    """`offpolicy config check` with Qwen2.5-7B's config.json: each learner's plan on one GPU."""
    from offpolicy.services.cli import main

    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_7B_CONFIG))
    monkeypatch.setenv("OFFPOLICY_MODEL_PATH", str(model))
    for name in ("learner-a.yaml", "learner-b.yaml"):
        assert main(["config", "check", str(POOL / name), "--gpus", "1", "--gpu-memory-gib", "80"]) == 0, name
        assert "fits 90% of 80 GiB" in capsys.readouterr().out, name


# --- docker compose


def merged() -> dict:
    return interpolate(merge_compose(load_compose(BASE), load_compose_resolved(COMPOSE)), env())


def host_file(service: dict, target: str) -> Path:
    source, mode = mounts(service)[target]
    assert mode == "ro" and source.startswith("./"), (target, source)
    return ROOT / source


def compose_env(service: dict) -> dict[str, str]:
    return {k: "" if v is None else str(v) for k, v in service["environment"].items()}


def test_the_override_validates_against_the_compose_spec():
    validate(strip_tags(load_compose(COMPOSE)))
    validate(merged())
    used: set[str] = set()
    interpolate(strip_tags(load_compose(COMPOSE)), env(), used)
    assert used - set(read_env_file(ROOT / ".env.example")) == set()
    assert "docker compose -f docker-compose.yml -f docker-compose.lora-pool.yml up -d" in COMPOSE.read_text()


def test_compose_two_learners_two_runs_one_pool(tmp_path):
    services = merged()["services"]
    learners = {
        name: load_learner_config(
            host_file(services[name], "/etc/offpolicy/learner.yaml"), compose_env(services[name])
        )
        for name in LEARNERS
    }
    actor = services["actor"]
    pool = load_pool(host_file(actor, "/etc/offpolicy/actor.yaml"), compose_env(actor))
    check_pool(learners, pool)
    assert host_file(services["learner"], "/etc/offpolicy/learner.yaml") == POOL / "learner-a.yaml"
    assert host_file(services["learner-b"], "/etc/offpolicy/learner.yaml") == POOL / "learner-b.yaml"
    # one weights volume: each learner writes its folder, the pool reads both at the root, read-only
    for name in LEARNERS:
        assert mounts(services[name])[str(WEIGHTS_ROOT)] == ("weights", "rw"), name
        assert mounts(services[name])["/var/lib/offpolicy/checkpoints"] == ("checkpoints", "rw"), name
    assert mounts(actor)[str(WEIGHTS_ROOT)] == ("weights", "ro")
    assert mounts(actor)[str(DATA)][1] == "ro"
    # learner-b is the learner with its own run: same health check, networks, Redis, model, tokens
    a, b = services["learner"], services["learner-b"]
    for key in ("healthcheck", "networks", "depends_on", "shm_size", "image"):
        assert a[key] == b[key], key
    differ = {k for k in compose_env(a) if compose_env(a)[k] != compose_env(b).get(k)}
    assert differ == {"OFFPOLICY_RUN_ID", "OFFPOLICY_METRICS_JSONL", "OFFPOLICY_TRACKING__TENSORBOARD_DIR"}
    assert a["ports"] != b["ports"] and b["ports"] == ["127.0.0.1:8002:8000"]
    for name in LEARNERS:
        assert actor["depends_on"][name] == {"condition": "service_healthy"}, name


def test_compose_one_gpu_each_none_shared():
    services = merged()["services"]
    plan = {name: gpu_ids(s) for name, s in services.items() if gpu_ids(s)}
    assert plan == {"learner": ["0"], "actor": ["1"], "learner-b": ["2"]}
    for name in LEARNERS:
        assert nproc_per_node(services[name]["command"]) == 1, name


def test_compose_prometheus_scrapes_both_learners_as_job_learner():
    services = merged()["services"]
    prometheus = services["prometheus"]
    (flag,) = (a for a in prometheus["command"] if a.startswith("--config.file="))
    assert flag == "--config.file=/etc/prometheus/prometheus.lora-pool.yml"
    assert mounts(prometheus)["/etc/prometheus"] == ("./deploy/prometheus", "ro")
    config_file = ROOT / "deploy" / "prometheus" / "prometheus.lora-pool.yml"
    pool = yaml.safe_load(config_file.read_text())
    base = yaml.safe_load(config_file.with_name("prometheus.yml").read_text())
    (job,) = (j for j in pool["scrape_configs"] if j["job_name"] == "learner")
    ports = {name: compose_env(services[name])["OFFPOLICY_PORT"] for name in LEARNERS}
    assert job["static_configs"] == [{"targets": [f"{name}:{port}" for name, port in ports.items()]}]
    for name in LEARNERS:
        assert "monitoring" in services[name]["networks"] and "monitoring" in prometheus["networks"], name
    # the rest is prometheus.yml's: the learner job's targets are the one difference
    (base_job,) = (j for j in base["scrape_configs"] if j["job_name"] == "learner")
    base_job["static_configs"] = job["static_configs"]
    assert pool == base
    out = subprocess.run([promtool(), "check", "config", str(config_file)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_bind_mounted_files_exist():
    for name, service in merged()["services"].items():
        sources = [source for source, _ in mounts(service).values()] if "volumes" in service else []
        for source in sources:
            if source.startswith(("./configs", "./deploy")):
                assert (ROOT / source).exists(), (name, source)


# --- Kubernetes


def workloads() -> dict[str, dict]:
    return {**by_kind(OVERLAY, "Deployment"), **by_kind(OVERLAY, "StatefulSet")}


def pod(name: str) -> tuple[dict, dict, dict]:
    """(pod template labels, pod spec, main container) of a Deployment or StatefulSet of the overlay."""
    template = workloads()[name]["spec"]["template"]
    return template["metadata"]["labels"], template["spec"], template["spec"]["containers"][0]


def k8s_config(name: str, file: str, tmp_path: Path) -> Path:
    """The config file a pod reads: its `config` volume's ConfigMap entry, written out."""
    _, spec, _ = pod(name)
    (volume,) = (v for v in spec["volumes"] if v["name"] == "config")
    path = tmp_path / f"{name}-{file}"
    path.write_text(config_maps(list(build(OVERLAY)))[volume["configMap"]["name"]][file])
    return path


def k8s_env(name: str) -> dict[str, str]:
    _, _, container = pod(name)
    return pod_environment(container, f"{name}-0", 0, config_maps(list(build(OVERLAY))))


def claims(name: str) -> dict[str, tuple[str, bool]]:
    """Mount path -> (claim, read-only) of a pod's claim volumes."""
    _, spec, container = pod(name)
    volumes = {v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    return {
        m["mountPath"]: (volumes[m["name"]]["claimName"], m.get("readOnly", False))
        for m in container["volumeMounts"]
        if m["name"] in volumes
    }


def test_k8s_two_learners_two_runs_one_pool(tmp_path):
    learners = {
        name: load_learner_config(k8s_config(name, "learner.yaml", tmp_path), k8s_env(name))
        for name in LEARNERS
    }
    pool = load_pool(k8s_config("actor", "actor.yaml", tmp_path), k8s_env("actor"))
    check_pool(learners, pool)
    for name, key, file in (
        ("learner", "learner.yaml", "learner-a.yaml"),
        ("learner-b", "learner.yaml", "learner-b.yaml"),
        ("actor", "actor.yaml", "actor.yaml"),
    ):
        assert k8s_config(name, key, tmp_path).read_text() == (POOL / file).read_text(), name
    # the shared claim `weights`: each learner writes its folder, the pool reads the root read-only
    for name in LEARNERS:
        assert claims(name)[str(WEIGHTS_ROOT)] == ("weights", False), name
    assert claims("actor")[str(WEIGHTS_ROOT)] == ("weights", True)
    # checkpoints and logs: a ReadWriteOnce claim each, so the two learners may run on different nodes
    for path in ("/var/lib/offpolicy/checkpoints", "/var/lib/offpolicy/logs"):
        assert len({claims(name)[path][0] for name in LEARNERS}) == 2, path
    pvcs = by_kind(OVERLAY, "PersistentVolumeClaim")
    assert {"checkpoints-b", "logs-b"} <= set(pvcs)


def test_k8s_each_learner_service_selects_its_own_pods_only():
    def selected(selector: dict[str, str]) -> list[str]:
        return [n for n in LEARNERS if all(pod(n)[0].get(k) == v for k, v in selector.items())]

    services = by_kind(OVERLAY, "Service")
    for name in LEARNERS:
        assert selected(services[name]["spec"]["selector"]) == [name], name
        # the workload's own selector too (a Deployment adopting the other's pods would fight over them)
        assert selected(workloads()[name]["spec"]["selector"]["matchLabels"]) == [name], name


def test_k8s_both_learners_reach_redis_and_are_scraped_as_job_learner():
    policies = by_kind(OVERLAY, "NetworkPolicy").values()
    redis = {"app.kubernetes.io/name": "redis"}
    for name in (*LEARNERS, "actor"):
        assert any(admits(p, pod(name)[0], redis, 6379) for p in policies), name
    (monitor,) = by_kind(OVERLAY, "ServiceMonitor").values()
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    (endpoint,) = monitor["spec"]["endpoints"]
    (job,) = (r for r in endpoint["relabelings"] if r["targetLabel"] == "job")
    (source,) = job["sourceLabels"]
    label = re.fullmatch(r"__meta_kubernetes_service_label_(\w+)", source)[1]
    services = by_kind(OVERLAY, "Service")
    for name in LEARNERS:
        labels = services[name]["metadata"]["labels"]
        assert labels[expression["key"]] in expression["values"], name  # selected
        assert {p["name"] for p in services[name]["spec"]["ports"]} >= {endpoint["port"]}, name
        # the job label: the Service's label, sanitized as Prometheus does (`.`, `/`, `-` -> `_`)
        (value,) = (v for k, v in labels.items() if re.sub(r"[^a-zA-Z0-9_]", "_", k) == label)
        assert value == "learner", name
    (rule,) = by_kind(OVERLAY, "PrometheusRule").values()
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert 'up{job="learner"} == 0' in exprs  # LearnerDown covers both learners


def test_k8s_one_gpu_each_and_the_learners_memory_holds_their_host_plan(tmp_path):
    """Each learner's memory limit is its LoRA host plan for Qwen2.5-7B on one process (the frozen bf16
    base, the adapter's checkpoint stager and published sets: offpolicy.learner.plan.host), in 16 GiB."""
    shape = QWEN_7B_CONFIG
    layers, hidden, inter = shape["num_hidden_layers"], shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    per_rank = 2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + inter)  # q o, k v, gate up down
    params = 7_615_616_512
    for name in (*LEARNERS, "actor"):
        resources = pod(name)[2]["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "1", name
    for name in LEARNERS:
        config = load_learner_config(k8s_config(name, "learner.yaml", tmp_path), k8s_env(name))
        adapter = layers * config.lora.rank * per_rank
        if config.lora.rank == 16:
            assert adapter == 40_370_176  # docs/lora.md: 40.4 M for Qwen2.5-7B at rank 16
        host = node_bytes(config, params, 1, 1, leader_node=True, adapter_params=adapter) / GIB
        limit = pod(name)[2]["resources"]["limits"]["memory"]
        assert limit == f"{ceil_to(host, 16)}Gi" and quantity_bytes(limit) >= host * GIB, (name, host)
        assert nproc_per_node(pod(name)[2]["args"]) is None, name  # one process
