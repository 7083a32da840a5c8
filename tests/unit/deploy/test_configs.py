"""configs/learner.yaml and configs/actor.yaml load with the real loaders, alone and with the environment
that each deployment (compose, compose + CPU override, k8s dev, k8s gpu) hands to each service."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from deploy.checks import (
    ROOT,
    SERVICE_CONFIGS,
    config_maps,
    gpu_ids,
    interpolate,
    kustomize,
    load_compose,
    load_compose_resolved,
    merge_compose,
    pod_environment,
    read_env_file,
)
from deploy.docker.entrypoint import set_replica_seeds
from offpolicy.actors.config import ActorConfig
from offpolicy.actors.config import load_config as load_actor_config
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config import load_config as load_learner_config

LOADERS = {"learner": load_learner_config, "actor": load_actor_config}
SECRETS = ("OFFPOLICY_API_TOKEN", "OFFPOLICY_GATEWAY_TOKEN", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD")


def test_the_config_files_load_with_the_real_loaders():
    learner = load_learner_config(SERVICE_CONFIGS["learner"])
    actor = load_actor_config(SERVICE_CONFIGS["actor"])
    assert isinstance(learner, LearnerConfig) and isinstance(actor, ActorConfig)
    assert actor.run_id == learner.run_id and actor.redis_url == learner.redis_url
    assert actor.model_path == learner.model_path


def test_the_actor_file_names_every_field_so_it_documents_them():
    written = yaml.safe_load(SERVICE_CONFIGS["actor"].read_text())

    def missing(model: type, data: dict, where: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            if name not in data:
                out.append(f"{where}{name}")
            elif (
                name != "buffer"
                and isinstance(field.annotation, type)
                and issubclass(field.annotation, BaseModel)
            ):
                out += missing(field.annotation, data[name], f"{where}{name}.")  # buffer: the learner's keys
        return out

    assert missing(ActorConfig, written, "") == []


def test_the_actor_buffer_is_the_learners_plus_producer_pacing():
    learner = load_learner_config(SERVICE_CONFIGS["learner"]).buffer
    actor = load_actor_config(SERVICE_CONFIGS["actor"]).buffer
    assert actor.max_ahead is not None
    assert actor.model_copy(update={"max_ahead": learner.max_ahead}) == learner


# --- the environment of each deployment


def compose_services(cpu: bool, **settings: str) -> dict[str, dict]:
    values = read_env_file(ROOT / ".env.example") | {name: f"test-{name.lower()}" for name in SECRETS}
    doc = load_compose(ROOT / "docker-compose.yml")
    if cpu:
        doc = merge_compose(doc, load_compose(ROOT / "docker-compose.cpu.yml"))
    return interpolate(doc, values | settings)["services"]


def compose_env(service: dict) -> dict[str, str]:
    return {k: "" if v is None else str(v) for k, v in service["environment"].items()}


def compose_mounts(service: dict) -> list[str]:
    return [v.split(":")[1] for v in service.get("volumes", [])]


def k8s_pods(overlay: str) -> dict[str, tuple[dict, list[str]]]:
    """name -> (its first container, the container's mount paths) for the learner and the actor."""
    out = {}
    for doc in kustomize(overlay):
        if doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] in LOADERS:
            container = doc["spec"]["template"]["spec"]["containers"][0]
            out[doc["metadata"]["name"]] = (container, [m["mountPath"] for m in container["volumeMounts"]])
    return out


def k8s_env(overlay: str, name: str, pod_name: str, index: int) -> dict[str, str]:
    """The environment the kubelet gives one pod of `name` (ConfigMap references resolved)."""
    return pod_environment(k8s_pods(overlay)[name][0], pod_name, index, config_maps(kustomize(overlay)))


def check_loaded(env: dict[str, dict[str, str]], mounts: dict[str, list[str]]) -> dict[str, object]:
    """Both services' configs under their deployment environment; the files they name are mounted."""
    configs = {name: LOADERS[name](SERVICE_CONFIGS[name], env[name]) for name in LOADERS}
    learner, actor = configs["learner"], configs["actor"]
    assert actor.model_path == learner.model_path
    assert actor.run_id == learner.run_id and actor.redis_url == learner.redis_url
    assert actor.buffer.model_copy(update={"max_ahead": None}) == learner.buffer
    assert actor.redis_url.endswith("@redis:6379/0"), "the password travels in the URL"
    for path, name in (
        (Path(actor.dataset.path).parent, "actor"),
        (learner.weights_path.parent, "learner"),
        (learner.publish.weights_root, "learner"),
        (actor.reload.weights_root, "actor"),  # relative weights_uri resolve under the actor's own mount
    ):
        assert str(path) in mounts[name], f"{name}: nothing is mounted at {path}"
    # one folder per run on the shared volumes: a new run id starts beside the old run
    assert learner.weights_path == Path("/var/lib/offpolicy/weights") / learner.run_id
    assert learner.checkpoint_path == Path("/var/lib/offpolicy/checkpoints") / learner.run_id
    return configs


@pytest.mark.parametrize("cpu", [False, True], ids=["compose", "compose-cpu"])
def test_compose_environment_gives_valid_configs(cpu):
    services = compose_services(cpu)
    env = {name: compose_env(services[name]) for name in LOADERS}
    set_replica_seeds(env["actor"])
    mounts = {name: compose_mounts(services[name]) for name in LOADERS}
    configs = check_loaded(env, mounts)
    assert configs["actor"].actor_index == 0
    if cpu:
        assert configs["actor"].engine.dtype == "float32" and configs["actor"].engine.enforce_eager


@pytest.mark.parametrize("overlay", ["dev", "gpu"], ids=["k8s-dev", "k8s-gpu-overlay"])
def test_k8s_environment_gives_valid_configs(overlay):
    pods = k8s_pods(overlay)
    env = {
        "learner": k8s_env(overlay, "learner", "learner-5d9f7-abcde", 0),
        "actor": k8s_env(overlay, "actor", "actor-0", 0),
    }
    set_replica_seeds(env["actor"])  # the actor image's entry point
    configs = check_loaded(env, {name: pods[name][1] for name in LOADERS})
    assert configs["actor"].actor_id == "actor-0" and configs["learner"].run_id == "default"


def test_scaled_actors_share_one_shard_with_their_own_seeds():
    """Three compose actor services (indices 0-2) and a 3-pod StatefulSet (ordinals 0-2): three actors,
    each the whole dataset, seeds 0-2."""
    base = compose_env(compose_services(cpu=False)["actor"])
    for k in range(3):
        compose = base | {"OFFPOLICY_REPLICA_INDEX": str(k)}
        pod = k8s_env("gpu", "actor", f"actor-{k}", k)
        for env in (compose, pod):
            set_replica_seeds(env)
            actor = load_actor_config(SERVICE_CONFIGS["actor"], env)
            assert (actor.actor_index, actor.num_actors) == (0, 1)
            assert (actor.dataset.seed, actor.engine.seed, actor.actor_id) == (k, k, f"actor-{k}")
            assert actor.dataset.shuffle, "one shard read in the same order by every actor would repeat it"


def test_the_8gpu_override_gives_each_actor_a_valid_config_and_its_own_seeds():
    """docker-compose.8gpu.yml: four actor services, each the whole dataset with seeds 0-3."""
    values = read_env_file(ROOT / ".env.example") | {name: f"test-{name.lower()}" for name in SECRETS}
    doc = merge_compose(
        load_compose(ROOT / "docker-compose.yml"), load_compose_resolved(ROOT / "docker-compose.8gpu.yml")
    )
    services = interpolate(doc, values)["services"]
    learner = load_learner_config(SERVICE_CONFIGS["learner"], compose_env(services["learner"]))
    seen = set()
    for name in ("actor", "actor-gpu5", "actor-gpu6", "actor-gpu7"):
        env = compose_env(services[name])
        set_replica_seeds(env)  # the image's entry point: seeds and id from OFFPOLICY_REPLICA_INDEX
        actor = load_actor_config(SERVICE_CONFIGS["actor"], env)
        assert actor.model_path == learner.model_path and actor.run_id == learner.run_id, name
        assert (actor.actor_index, actor.num_actors) == (0, 1), name
        assert actor.dataset.seed == actor.engine.seed, name
        seen.add((actor.dataset.seed, actor.actor_id))
    assert seen == {(k, f"actor-{k}") for k in range(4)}


def test_the_8gpu_eval_override_makes_gpu7_an_evaluation_actor_and_the_rest_train_only():
    """docker-compose.8gpu-eval.yml on the verl recipe's actor config (which has verl's validation): GPU
    7's actor only evaluates, the three others only train; no GPU changes hands."""
    values = read_env_file(ROOT / ".env.example") | {name: f"test-{name.lower()}" for name in SECRETS}
    doc = merge_compose(
        load_compose(ROOT / "docker-compose.yml"), load_compose_resolved(ROOT / "docker-compose.8gpu.yml")
    )
    doc = merge_compose(doc, load_compose_resolved(ROOT / "docker-compose.8gpu-eval.yml"))
    services = interpolate(doc, values)["services"]
    recipe = ROOT / "configs" / "recipes" / "verl-gsm8k-grpo" / "actor.yaml"
    modes = {}
    for name in ("actor", "actor-gpu5", "actor-gpu6", "actor-gpu7"):
        env = compose_env(services[name])
        set_replica_seeds(env)
        actor = load_actor_config(recipe, env)
        modes[name] = (actor.mode, actor.eval is not None)
    assert modes == {
        "actor": ("train", False), "actor-gpu5": ("train", False), "actor-gpu6": ("train", False),
        "actor-gpu7": ("eval", True),
    }  # fmt: skip
    assert gpu_ids(services["actor-gpu7"]) == ["7"] and gpu_ids(services["actor"]) == ["4"]


@pytest.mark.parametrize("deployment", ["compose", "k8s-gpu"])
def test_a_new_run_id_moves_the_weights_and_checkpoints(deployment):
    """The run id set in its one place (.env / the `offpolicy-run` ConfigMap) reaches the learner's weights
    and checkpoint folders and the actor's run id."""
    if deployment == "compose":
        services = compose_services(cpu=False, OFFPOLICY_RUN_ID="exp-2")
        env = {name: compose_env(services[name]) for name in LOADERS}
    else:
        docs = kustomize("gpu")
        (run,) = (
            d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("offpolicy-run")
        )
        assert run["data"] == {"run-id": "default"}
        maps = config_maps(docs) | {run["metadata"]["name"]: {"run-id": "exp-2"}}
        pods = k8s_pods("gpu")
        env = {
            "learner": pod_environment(pods["learner"][0], "learner-0", 0, maps),
            "actor": pod_environment(pods["actor"][0], "actor-0", 0, maps),
        }
    set_replica_seeds(env["actor"])
    learner = load_learner_config(SERVICE_CONFIGS["learner"], env["learner"])
    actor = load_actor_config(SERVICE_CONFIGS["actor"], env["actor"])
    assert learner.run_id == actor.run_id == "exp-2"
    assert learner.weights_path == Path("/var/lib/offpolicy/weights/exp-2")
    assert learner.checkpoint_path == Path("/var/lib/offpolicy/checkpoints/exp-2")
