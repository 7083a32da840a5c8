"""docker-compose.yml and the CPU override: compose-spec schema, secrets, Redis, GPUs, health, scaling."""

from __future__ import annotations

import re

import jsonschema
import pytest
from check_jsonschema.builtin_schemas import get_builtin_schema

from deploy.checks import (
    ROOT,
    MissingVariable,
    interpolate,
    load_compose,
    merge_compose,
    read_env_file,
    strip_tags,
)

BASE = ROOT / "docker-compose.yml"
CPU = ROOT / "docker-compose.cpu.yml"
SECRETS = ("OFFPOLICY_API_TOKEN", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD")


def env() -> dict[str, str]:
    """.env.example with the three secrets filled, as a user's .env would be."""
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


@pytest.mark.parametrize("path", [BASE, CPU], ids=lambda p: p.name)
def test_each_file_as_written_validates_against_the_compose_spec(path):
    validate(strip_tags(load_compose(path)))


def test_interpolated_and_merged_files_validate_against_the_compose_spec():
    validate(base())
    validate(merged_cpu())


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
    for path in (BASE, CPU):
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
    assert gpu_devices(services["learner"]) == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    # the actor's own GPU, by id (not `count`, which gives every reservation the first GPU)
    assert gpu_devices(services["actor"]) == [
        {"driver": "nvidia", "device_ids": ["1"], "capabilities": ["gpu"]}
    ]
    cpu = merged_cpu()["services"]
    for name in ("learner", "actor"):
        assert gpu_devices(cpu[name]) == []
        assert cpu[name]["build"]["target"] == "cpu"
        model_var = "OFFPOLICY_MODEL_PATH" if name == "learner" else "OFFPOLICY_ENGINE__MODEL"
        assert cpu[name]["environment"][model_var] == "/var/lib/offpolicy/models/tiny"
        assert cpu[name]["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
    assert cpu["model-init"]["command"] == ["make-tiny-model", "/var/lib/offpolicy/models/tiny"]
    assert cpu["actor"]["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_actor_scales_no_fixed_name_no_host_port_one_shard_no_fixed_seed():
    actor = base()["services"]["actor"]
    assert "container_name" not in actor and "ports" not in actor and "hostname" not in actor
    assert actor["deploy"]["replicas"] == "1"  # ${ACTOR_REPLICAS:-1}; `--scale actor=N` overrides it
    # one shard for every replica; the entrypoint gives each its own seeds (test_deploy_images.py)
    assert actor["environment"]["OFFPOLICY_ACTOR_INDEX"] == "0"
    assert actor["environment"]["OFFPOLICY_NUM_ACTORS"] == "1"
    assert "OFFPOLICY_DATASET__SEED" not in actor["environment"]


def test_health_checks_and_ordered_start():
    for services in (base()["services"], merged_cpu()["services"]):
        for name, service in services.items():
            if name != "model-init":
                assert service["healthcheck"]["test"], name
            for dep, cond in service.get("depends_on", {}).items():
                assert cond["condition"] in ("service_healthy", "service_completed_successfully"), (name, dep)
    services = base()["services"]
    assert services["learner"]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert set(services["actor"]["depends_on"]) == {"redis", "learner"}
    assert services["learner"]["healthcheck"]["test"][-1].endswith("healthcheck.py")


def test_weights_volume_is_shared_and_read_only_for_actors():
    services = base()["services"]
    assert "weights:/var/lib/offpolicy/weights" in services["learner"]["volumes"]
    assert "weights:/var/lib/offpolicy/weights:ro" in services["actor"]["volumes"]
    assert (
        services["learner"]["environment"]["OFFPOLICY_PUBLISH__WEIGHTS_DIR"] == "/var/lib/offpolicy/weights"
    )


def test_bind_mounted_files_exist():
    for services in (base()["services"], merged_cpu()["services"]):
        for service in services.values():
            for volume in service.get("volumes", []):
                source = volume.split(":")[0]
                if source.startswith("./") and source != "./data":  # the user's dataset folder
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
