"""docker-compose.yml and its CPU and 8-GPU overrides: compose-spec schema, secrets, Redis, GPUs, health."""

from __future__ import annotations

import re

import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from deploy.checks import (
    ROOT,
    ComposeLoader,
    MissingVariable,
    gpu_ids,
    interpolate,
    load_compose,
    load_compose_resolved,
    merge_compose,
    nproc_per_node,
    read_env_file,
    resolve_extends,
    strip_tags,
)

BASE = ROOT / "docker-compose.yml"
CPU = ROOT / "docker-compose.cpu.yml"
GPU8 = ROOT / "docker-compose.8gpu.yml"
GPU8_EVAL = ROOT / "docker-compose.8gpu-eval.yml"
SECRETS = ("OFFPOLICY_API_TOKEN", "OFFPOLICY_GATEWAY_TOKEN", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD")
USER_FOLDERS = ("./data", "./models", "./code")  # the user's dataset, model and code folders (not in git)


def env() -> dict[str, str]:
    """.env.example with the four secrets filled, as a user's .env would be."""
    values = read_env_file(ROOT / ".env.example")
    return values | {name: f"test-{name.lower()}" for name in SECRETS}


def validate(doc: dict) -> None:
    validator = jsonschema.Draft7Validator(get_builtin_schema("vendor.compose-spec"))
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def base() -> dict:
    return interpolate(strip_tags(load_compose(BASE)), env())


def merged_cpu() -> dict:
    return interpolate(merge_compose(load_compose(BASE), load_compose(CPU)), env())


def merged_8gpu() -> dict:
    return interpolate(merge_compose(load_compose(BASE), load_compose_resolved(GPU8)), env())


@pytest.mark.parametrize("path", [BASE, CPU, GPU8, GPU8_EVAL], ids=lambda p: p.name)
def test_each_file_as_written_validates_against_the_compose_spec(path):
    validate(strip_tags(load_compose(path)))


def test_interpolated_and_merged_files_validate_against_the_compose_spec():
    validate(base())
    validate(merged_cpu())
    validate(merged_8gpu())
    validate(interpolate(merge_compose(merge_compose(load_compose(BASE), load_compose_resolved(GPU8)),
                                       load_compose(GPU8_EVAL)), env()))  # fmt: skip


@pytest.mark.parametrize("secret", SECRETS)
def test_each_secret_is_required(secret):
    without = env() | {secret: ""}
    with pytest.raises(MissingVariable, match=secret):
        interpolate(load_compose(BASE), without)
    text = BASE.read_text()
    assert re.search(r"\$\{" + secret + r":\?[^}]+\}", text), (
        f"{secret} must be written ${{{secret}:?message}}"
    )


def test_every_variable_is_in_env_example():
    used: set[str] = set()
    for path in (BASE, CPU, GPU8):
        interpolate(strip_tags(load_compose(path)), env(), used)
    documented = set(read_env_file(ROOT / ".env.example"))
    assert used - documented == set()
    assert used >= set(SECRETS)


def test_redis_is_7_with_aof_everysec_noeviction_password_and_a_volume():
    redis = base()["services"]["redis"]
    assert re.fullmatch(r"redis:7\.\d+\.\d+-alpine", redis["image"])
    assert "--requirepass" in redis["command"][-1]
    assert redis["environment"]["REDIS_PASSWORD"] == "test-redis_password"
    assert "redis-data:/data" in redis["volumes"]
    conf = (ROOT / "deploy" / "redis" / "redis.conf").read_text().splitlines()
    for line in ("appendonly yes", "appendfsync everysec", "maxmemory-policy noeviction", "dir /data"):
        assert line in conf
    assert redis["networks"] == ["backend"], "only the backend network (learner, actors) reaches Redis"


def test_services_get_the_password_and_token_through_the_environment():
    services = base()["services"]
    for name in ("learner", "actor"):
        environment = services[name]["environment"]
        assert environment["OFFPOLICY_REDIS_URL"] == "redis://:test-redis_password@redis:6379/0"
        assert environment["OFFPOLICY_API_TOKEN"] == "test-offpolicy_api_token"
        assert environment["OFFPOLICY_HOST"] == "0.0.0.0"


def gpu_devices(service: dict) -> list:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_learner_and_actor_reserve_a_gpu_and_the_cpu_override_drops_it():
    services = base()["services"]
    assert gpu_devices(services["learner"]) == [
        {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}
    ]
    # the actor's own GPU, by id (not `count`, which gives every reservation the first GPU)
    assert gpu_devices(services["actor"]) == [
        {"driver": "nvidia", "device_ids": ["1"], "capabilities": ["gpu"]}
    ]
    cpu = merged_cpu()["services"]
    for name in ("learner", "actor"):
        assert gpu_devices(cpu[name]) == []
        assert cpu[name]["build"]["target"] == "cpu"
        assert cpu[name]["environment"]["OFFPOLICY_MODEL_PATH"] == "/var/lib/offpolicy/tiny-model/tiny"
        assert cpu[name]["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
    assert cpu["model-init"]["command"] == ["make-tiny-model", "/var/lib/offpolicy/tiny-model/tiny"]
    assert cpu["actor"]["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


def gpu_plan(services: dict) -> dict[str, list[str]]:
    """Service -> the host GPU ids it reserves, for the services that reserve any."""
    return {name: gpu_ids(service) for name, service in services.items() if gpu_devices(service)}


def assert_one_rank_per_gpu_and_no_gpu_shared(services: dict) -> None:
    plan = gpu_plan(services)
    for name, ids in plan.items():
        assert not any(i.startswith("count:") for i in ids), (
            f"{name}: `count` gives every service GPUs 0..n-1; reserve GPUs by device_ids"
        )
        assert ids and all(i.isdigit() for i in ids) and len(set(ids)) == len(ids), (name, ids)
    learner = services["learner"]
    nproc = nproc_per_node(learner["command"])
    assert nproc == len(plan["learner"]), f"learner: {nproc} ranks on GPUs {plan['learner']}"
    owners: dict[str, str] = {}
    for name, ids in plan.items():
        for gpu in ids:
            assert gpu not in owners, f"GPU {gpu} is reserved by {owners[gpu]} and {name}"
            owners[gpu] = name


@pytest.mark.parametrize(
    "settings",
    [{}, {"LEARNER_GPU_IDS": "0,1,2,3", "LEARNER_NPROC": "4", "ACTOR_GPU_ID": "4"}],
    ids=["env-example", "learner-on-4-gpus"],
)
def test_learner_gpus_by_id_one_rank_each_and_none_shared_with_the_actor(settings):
    services = interpolate(strip_tags(load_compose(BASE)), env() | settings)["services"]
    assert_one_rank_per_gpu_and_no_gpu_shared(services)
    expected = settings.get("LEARNER_GPU_IDS", "0")
    assert gpu_devices(services["learner"])[0]["device_ids"] == [expected]
    assert services["learner"]["command"][-2:] == ["--nproc-per-node", settings.get("LEARNER_NPROC", "1")]


def test_defaults_without_env_file_keep_the_learner_and_the_actor_apart():
    only_secrets = {name: "x" for name in SECRETS}
    services = interpolate(strip_tags(load_compose(BASE)), only_secrets)["services"]
    assert_one_rank_per_gpu_and_no_gpu_shared(services)
    assert gpu_plan(services) == {"learner": ["0"], "actor": ["1"]}
    assert read_env_file(ROOT / ".env.example")["LEARNER_GPU_IDS"] == "0"
    assert read_env_file(ROOT / ".env.example")["ACTOR_GPU_ID"] == "1"


def test_a_mismatched_rank_count_or_a_shared_gpu_is_caught():
    """The check above can fail: 2 ranks on 1 GPU, the actor on a learner GPU, `count` reservations."""
    for settings in ({"LEARNER_NPROC": "2"}, {"LEARNER_GPU_IDS": "0,1"}):
        services = interpolate(strip_tags(load_compose(BASE)), env() | settings)["services"]
        with pytest.raises(AssertionError):
            assert_one_rank_per_gpu_and_no_gpu_shared(services)
    services = base()["services"]
    services["learner"]["deploy"]["resources"]["reservations"]["devices"] = [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    with pytest.raises(AssertionError, match="count"):
        assert_one_rank_per_gpu_and_no_gpu_shared(services)


def shm_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower()).groups()
    return int(number) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit]


def test_learner_has_shared_memory_for_its_ranks():
    learner = base()["services"]["learner"]
    assert learner.get("ipc") == "host" or shm_bytes(learner["shm_size"]) >= 2**30, "NCCL needs /dev/shm"
    assert learner["ulimits"]["memlock"] == -1
    cpu = merged_cpu()["services"]["learner"]
    assert shm_bytes(cpu["shm_size"]) <= shm_bytes(cpu["deploy"]["resources"]["limits"]["memory"])


def test_8gpu_override_one_gpu_per_actor_four_learner_ranks_own_seeds():
    services = merged_8gpu()["services"]
    assert_one_rank_per_gpu_and_no_gpu_shared(services)
    plan = gpu_plan(services)
    assert plan["learner"] == ["0", "1", "2", "3"]
    actors = {name: s for name, s in services.items() if name == "actor" or name.startswith("actor-")}
    assert sorted(gpu for name in actors for gpu in plan[name]) == ["4", "5", "6", "7"]
    indices = set()
    for name, actor in actors.items():
        assert actor["deploy"]["replicas"] == 1, name  # a second replica would share the service's GPU
        assert actor["command"] == ["actor", "--config", "/etc/offpolicy/actor.yaml"], name
        environment = actor["environment"]
        assert environment["OFFPOLICY_REDIS_URL"] == "redis://:test-redis_password@redis:6379/0", name
        # each service its own explicit index (the entry point derives seeds and id from it)
        indices.add(environment["OFFPOLICY_REPLICA_INDEX"])
        assert not {"OFFPOLICY_DATASET__SEED", "OFFPOLICY_ACTOR_ID"} & set(environment), name
        if name != "actor":
            # Prometheus finds actors by the DNS name `actor` (deploy/prometheus/prometheus.yml)
            for network in ("backend", "monitoring"):
                assert "actor" in actor["networks"][network]["aliases"], (name, network)
            assert "weights:/var/lib/offpolicy/weights:ro" in actor["volumes"], name
    assert indices == {"0", "1", "2", "3"}


def test_extending_the_actor_without_override_would_add_its_gpu_to_the_base_one():
    """Why the 8-GPU file says `!override`: compose appends device reservations on merge and extends."""
    text = GPU8.read_text().replace("devices: !override", "devices:")
    without = resolve_extends(yaml.load(text, Loader=ComposeLoader), ROOT)
    services = interpolate(merge_compose(load_compose(BASE), without), env())["services"]
    assert gpu_ids(services["actor-gpu5"]) == ["1", "5"]
    with pytest.raises(AssertionError):
        assert_one_rank_per_gpu_and_no_gpu_shared(services)


def test_actor_one_replica_explicit_index_one_shard_its_gateway_port_on_localhost():
    actor = base()["services"]["actor"]
    assert "container_name" not in actor
    # the gateway for agents: 8001 (OFFPOLICY_PORT) on localhost unless ACTOR_BIND says otherwise, with its
    # own token, not the admin one
    assert actor["ports"] == ["127.0.0.1:8001:8001"] and actor["environment"]["OFFPOLICY_PORT"] == "8001"
    token = actor["environment"]["OFFPOLICY_GATEWAY_TOKEN"]
    assert token == "test-offpolicy_gateway_token" != actor["environment"]["OFFPOLICY_API_TOKEN"]
    # the 8-GPU override's further actors publish no host port (one port, one service)
    for name, service in merged_8gpu()["services"].items():
        if name.startswith("actor-gpu"):
            assert "ports" not in service, name
    # W&B reaches the learner (empty: none) and never the actors
    assert base()["services"]["learner"]["environment"]["WANDB_API_KEY"] == ""
    assert "WANDB_API_KEY" not in actor["environment"]
    assert actor["deploy"]["replicas"] == 1  # replicas would share the index: more actors = more services
    # one shard for every actor; the entry point turns the explicit index into seeds (test_deploy_images.py)
    assert actor["environment"]["OFFPOLICY_REPLICA_INDEX"] == "0"
    assert actor["environment"]["OFFPOLICY_ACTOR_INDEX"] == "0"
    assert actor["environment"]["OFFPOLICY_NUM_ACTORS"] == "1"
    assert "OFFPOLICY_DATASET__SEED" not in actor["environment"]


ONE_SHOT = {"model-init", "model-fetch"}  # run once and exit: no health check, `restart: "no"`


def test_health_checks_and_ordered_start():
    for services in (base()["services"], merged_cpu()["services"]):
        for name, service in services.items():
            if name in ONE_SHOT:
                assert service["healthcheck"] == {"disable": True} and service["restart"] == "no", name
            else:
                assert service["healthcheck"]["test"], name
            for dep, cond in service.get("depends_on", {}).items():
                assert cond["condition"] in ("service_healthy", "service_completed_successfully"), (name, dep)
    services = base()["services"]
    fetched = {"condition": "service_completed_successfully"}
    assert services["learner"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "model-fetch": fetched,
    }
    assert set(services["actor"]["depends_on"]) == {"redis", "model-fetch", "learner"}
    assert services["actor"]["depends_on"]["model-fetch"] == fetched
    assert services["learner"]["healthcheck"]["test"][-1].endswith("healthcheck.py")


def test_weights_volume_is_shared_and_read_only_for_actors():
    services = base()["services"]
    assert "weights:/var/lib/offpolicy/weights" in services["learner"]["volumes"]
    assert "weights:/var/lib/offpolicy/weights:ro" in services["actor"]["volumes"]
    environment = services["learner"]["environment"]
    assert environment["OFFPOLICY_PUBLISH__WEIGHTS_DIR"] == "/var/lib/offpolicy/weights/{run_id}"
    assert environment["OFFPOLICY_CHECKPOINT__CHECKPOINT_DIR"] == "/var/lib/offpolicy/checkpoints/{run_id}"


def test_bind_mounted_files_exist():
    for services in (base()["services"], merged_cpu()["services"]):
        for service in services.values():
            for volume in service.get("volumes", []):
                source = volume.split(":")[0]
                if source.startswith("./") and source not in USER_FOLDERS:
                    assert (ROOT / source).exists(), source


def test_prometheus_and_grafana_are_provisioned_from_deploy():
    services = base()["services"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    grafana = services["grafana"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./deploy/grafana/dashboards:/etc/grafana/dashboards:ro" in grafana["volumes"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "deploy/grafana/dashboards" / home.rsplit("/", 1)[1]).is_file()
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "test-grafana_admin_password"
    assert set(services["prometheus"]["networks"]) == {"monitoring"}


def test_published_ports_bind_to_localhost_by_default():
    for name, service in base()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_interpolation_rules():
    assert interpolate("${A:-x}", {}) == "x"
    assert interpolate("${A:-x}", {"A": ""}) == "x"
    assert interpolate("${A-x}", {"A": ""}) == ""
    assert interpolate("$$A ${B}", {"B": "b"}) == "$A b"
    with pytest.raises(MissingVariable, match="A: say why"):
        interpolate("${A:?say why}", {"A": ""})


# --- your model and your code, in every learner and actor service, from one setting each

MODEL_MOUNT = "/var/lib/offpolicy/models"
CODE_MOUNT = "/opt/offpolicy/code"


def training_services(services: dict) -> dict[str, dict]:
    """The learner and every actor service (the 8-GPU override's extra actors included)."""
    return {n: s for n, s in services.items() if n == "learner" or n == "actor" or n.startswith("actor-")}


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """Container path -> (source, mode) of a service's short-syntax volumes."""
    out = {}
    for volume in service["volumes"]:
        source, target, *mode = volume.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


@pytest.mark.parametrize("stack", [base, merged_cpu, merged_8gpu], ids=["compose", "cpu", "8gpu"])
def test_every_learner_and_actor_mounts_the_model_and_the_code_read_only(stack):
    services = training_services(stack()["services"])
    assert {"learner", "actor"} <= set(services)
    for name, service in services.items():
        mounted = mounts(service)
        assert mounted[MODEL_MOUNT] == ("./models", "ro"), name
        assert mounted[CODE_MOUNT] == ("./code", "ro"), name
        assert service["environment"]["PYTHONPATH"] == CODE_MOUNT, name
    if stack is merged_8gpu:
        assert {"actor-gpu5", "actor-gpu6", "actor-gpu7"} <= set(services)


def test_one_setting_moves_the_model_and_the_code_of_every_service():
    """OFFPOLICY_MODEL_DIR / OFFPOLICY_CODE_DIR change every service's mount (the 8-GPU actors too), and
    the 8-GPU file repeats no mount: its actors inherit them through `extends`."""
    settings = {"OFFPOLICY_MODEL_DIR": "/srv/models", "OFFPOLICY_CODE_DIR": "/home/me/rl-code"}
    doc = merge_compose(load_compose(BASE), load_compose_resolved(GPU8))
    services = training_services(interpolate(doc, env() | settings)["services"])
    assert len(services) == 5
    for name, service in services.items():
        assert mounts(service)[MODEL_MOUNT] == ("/srv/models", "ro"), name
        assert mounts(service)[CODE_MOUNT] == ("/home/me/rl-code", "ro"), name
    assert "volumes" not in GPU8.read_text().split("services:", 1)[1], "the 8-GPU file repeats mounts"
    text = BASE.read_text()
    assert text.count("${OFFPOLICY_MODEL_DIR") == 1 and text.count("${OFFPOLICY_CODE_DIR") == 1, (
        "one anchor each"
    )


def test_the_dns_lookup_of_the_replica_name_is_gone():
    """Every actor has its index from its own service's setting; no compose file relies on names."""
    for path in (BASE, CPU, GPU8):
        assert "--scale actor" not in path.read_text().replace("never `--scale actor=N`", ""), path.name
    assert "ACTOR_REPLICAS" not in read_env_file(ROOT / ".env.example")
