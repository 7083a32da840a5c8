"""configs/recipes/qwen2.5-7b-gsm8k: the recipe passes `offpolicy config check` for 8 GPUs of 80 GiB (with the
model's config.json and verl's parquet on this machine), its `.env` runs the 8-GPU compose, its Kubernetes
overlay (k8s/overlays/qwen2.5-7b-gsm8k, 2 nodes) builds and is deploy/sizing.py's 7B row with each learner
pod holding node 0's host plan, and every example of docs/coming-from-verl.md validates."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from deploy.checks import ROOT, kustomize, load_compose_resolved, read_env_file
from deploy.sizing import ROWS, SHM_GIB, ceil_to, size_run
from offpolicy.actors.config import ActorConfig
from offpolicy.actors.config import load_config as load_actor_config
from offpolicy.learner.config import load_config as load_learner_config
from offpolicy.learner.plan.host import node_bytes
from offpolicy.learner.plan.memory import GIB
from offpolicy.services.cli import build_parser, main
from tests.data.gsm8k import verl_rows
from tests.data.models import QWEN_7B_CONFIG, write_config

RECIPE = ROOT / "configs" / "recipes" / "qwen2.5-7b-gsm8k"
OVERLAY = "qwen2.5-7b-gsm8k"
VERL_DOC = ROOT / "docs" / "coming-from-verl.md"
HOST = "kubernetes.io/hostname"
SEVEN_B = {w.name: w for w in ROWS}["7B"]


@pytest.fixture
def local_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The recipe's model (its config.json only) and verl's GSM8K parquet on this machine, named by the
    OFFPOLICY_* overrides compose and Kubernetes set, and the reward module's folder on sys.path."""
    model = write_config(tmp_path / "Qwen2.5-7B-Instruct", QWEN_7B_CONFIG)
    pq.write_table(pa.Table.from_pylist(verl_rows()), tmp_path / "train.parquet")
    monkeypatch.setenv("OFFPOLICY_MODEL_PATH", str(model))
    monkeypatch.setenv("OFFPOLICY_DATASET__PATH", str(tmp_path / "train.parquet"))
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "verl"))
    return tmp_path


def test_the_recipe_passes_the_offline_check_on_8_gpus(local_run: Path, capsys: pytest.CaptureFixture[str]):
    learner, actor = str(RECIPE / "learner.yaml"), str(RECIPE / "actor.yaml")
    assert main(["config", "check", learner, actor, "--gpus", "8", "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "per rank on 8 GPU(s) (FSDP2, 7,615,616,512 parameters" in out
    assert "fits 90% of 80 GiB" in out
    assert "reward: gsm8k_reward.compute_score (signature verl)" in out
    assert "records read, 3 with an answer (`reward_model.ground_truth`)" in out
    # the 8-GPU compose's learner: 4 ranks (docker-compose.8gpu.yml), its plan fits too
    assert main(["config", "check", learner, "--gpus", "4", "--gpu-memory-gib", "80"]) == 0


def test_without_the_model_here_the_check_names_it(local_run: Path, monkeypatch, capsys):
    """A hub id not in the cache: the documented reason, no download."""
    monkeypatch.setenv("OFFPOLICY_MODEL_PATH", str(local_run / "not-here"))
    assert main(["config", "check", str(RECIPE / "learner.yaml"), "--gpus", "8"]) == 1
    assert "model_path: its config.json cannot be read here" in capsys.readouterr().err


def test_the_recipe_maps_verls_gsm8k_example():
    learner = load_learner_config(RECIPE / "learner.yaml", {})
    actor = load_actor_config(RECIPE / "actor.yaml", {})
    assert learner.model_path == actor.model_path == "Qwen/Qwen2.5-7B-Instruct"
    assert learner.run_id == actor.run_id
    assert learner.kl_loss_coef > 0 and learner.kl_loss_type == "low_var_kl"
    assert learner.groups_per_step % learner.mini_batch_groups == 0
    assert actor.dataset.preset == "verl" and actor.dataset.chat_template is not False
    assert actor.reward.signature == "verl"
    assert actor.engine.max_model_len >= actor.sampling.max_tokens + SEVEN_B.prompt_tokens
    assert actor.sampling.max_tokens == SEVEN_B.response_tokens  # the sizing row's T


def test_the_recipe_env_runs_the_8gpu_compose():
    """Every key of the recipe's .env is one .env.example documents; the files it names exist; the model
    is the recipe's, the learner's ranks are the 7B row's with this learner.yaml (4: GPUs 0-3)."""
    env = read_env_file(RECIPE / ".env")
    example = read_env_file(ROOT / ".env.example")
    assert set(env) <= set(example), set(env) - set(example)
    for key in ("LEARNER_CONFIG", "ACTOR_CONFIG", "OFFPOLICY_CODE_DIR"):
        assert (ROOT / env[key]).exists(), key
    assert (ROOT / env["OFFPOLICY_CODE_DIR"] / "gsm8k_reward.py").exists()
    actor = load_actor_config(ROOT / env["ACTOR_CONFIG"], {})
    assert env["OFFPOLICY_MODEL"] == actor.model_path and env["ACTOR_DATASET_FILE"].endswith(".parquet")
    row = size_run(load_learner_config(ROOT / env["LEARNER_CONFIG"], {}), actor, SEVEN_B.shape)
    eight = load_compose_resolved(ROOT / "docker-compose.8gpu.yml")["services"]
    assert eight["learner"]["command"][-1] == str(row.learner_gpus)
    assert env["REDIS_MAXMEMORY"] == f"{row.redis_maxmemory_mib}mb"


def test_the_overlay_is_one_learner_node_and_one_actor_node_at_the_recipes_sizes():
    """Two nodes of 8 GPUs: the learner in one pod with one node's 8 GPUs (at least the sizes' count), its
    limit holding its host plan and /dev/shm; 8 actors of one GPU together on the other node (required
    affinity to each other, anti-affinity to the learner: no 5/3 split), no autoscaler; the recipe's
    volumes and Redis (deploy/sizing.py on its configs), a hub cache holding the model twice; the recipe's
    files as the ConfigMaps."""
    config = load_learner_config(RECIPE / "learner.yaml", {})
    row = size_run(config, load_actor_config(RECIPE / "actor.yaml", {}), SEVEN_B.shape)  # this run's sizes
    docs = kustomize(OVERLAY)
    assert "HorizontalPodAutoscaler" not in {d["kind"] for d in docs}
    (jobset,) = (d for d in docs if d["kind"] == "JobSet")
    (rjob,) = jobset["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    (node,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in node["env"]}
    nodes, per_node = int(env["OFFPOLICY_NNODES"]), int(env["OFFPOLICY_NPROC_PER_NODE"])
    assert nodes == 1 == rjob["template"]["spec"]["parallelism"] == rjob["template"]["spec"]["completions"]
    assert node["resources"]["limits"]["nvidia.com/gpu"] == str(per_node) == "8"
    assert node["resources"]["requests"]["nvidia.com/gpu"] == str(per_node)
    assert nodes * per_node >= row.learner_gpus
    host_gib = node_bytes(config, SEVEN_B.shape.params, nodes * per_node, per_node, leader_node=True) / GIB
    assert node["resources"]["limits"]["memory"] == f"{ceil_to(host_gib + SHM_GIB, 16)}Gi"
    assert {"WANDB_API_KEY", "OFFPOLICY_PUBLISH__WEIGHTS_ROOT"} <= set(env)
    actor_term = {"labelSelector": {"matchLabels": {"app.kubernetes.io/name": "actor"}}, "topologyKey": HOST}
    learner_term = {
        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "learner"}},
        "topologyKey": HOST,
    }
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        actor_term
    ]
    assert rjob["template"]["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "learner"

    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    claims = {n: d for (k, n), d in by_name.items() if k == "PersistentVolumeClaim"}
    assert claims["weights"]["spec"]["resources"]["requests"]["storage"] == f"{row.weights_gib}Gi"
    assert claims["checkpoints"]["spec"]["resources"]["requests"]["storage"] == f"{row.checkpoints_gib}Gi"
    cache = int(claims["hf-cache"]["spec"]["resources"]["requests"]["storage"].removesuffix("Gi"))
    assert cache * GIB >= 2 * 2 * SEVEN_B.shape.params  # the bf16 weights twice
    (redis,) = by_name[("StatefulSet", "redis")]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in redis["env"]}[
        "REDIS_MAXMEMORY"
    ] == f"{row.redis_maxmemory_mib}mb"
    assert redis["resources"]["limits"]["memory"] == f"{row.redis_limit_gib}Gi"
    actors = by_name[("StatefulSet", "actor")]
    affinity = actors["spec"]["template"]["spec"]["affinity"]
    assert affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [actor_term]
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [learner_term]
    (actor,) = actors["spec"]["template"]["spec"]["containers"]
    actor_env = {e["name"]: e.get("value") for e in actor["env"]}
    assert actor["resources"]["limits"]["nvidia.com/gpu"] == str(row.actor_gpus)
    assert actor_env["OFFPOLICY_ENGINE__TENSOR_PARALLEL_SIZE"] == str(row.actor_gpus)
    assert actor_env["OFFPOLICY_MODEL_PATH"] == env["OFFPOLICY_MODEL_PATH"] == config.model_path
    # two nodes of 8 GPUs: the learner's node and the actors' node
    assert per_node == 8 == actors["spec"]["replicas"] * row.actor_gpus
    maps = {n.rsplit("-", 1)[0]: d["data"] for (k, n), d in by_name.items() if k == "ConfigMap"}
    assert maps["learner-config"]["learner.yaml"] == (RECIPE / "learner.yaml").read_text()
    assert maps["actor-config"]["actor.yaml"] == (RECIPE / "actor.yaml").read_text()


# --- docs/coming-from-verl.md: every example validates

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def doc_blocks(lang: str) -> list[str]:
    return [body for kind, body in _BLOCK.findall(VERL_DOC.read_text()) if kind == lang]


def test_every_yaml_example_of_the_verl_page_validates():
    """Each block is a fragment of the learner's or the actor's config: it validates merged into the
    recipe's file of that service (a section of the actor: `dataset`, `reward`, ...)."""
    blocks = doc_blocks("yaml")
    assert len(blocks) >= 3  # data, reward, the recipe's learner
    actor_fields = set(ActorConfig.model_fields)
    base_actor = yaml.safe_load((RECIPE / "actor.yaml").read_text())
    base_learner = yaml.safe_load((RECIPE / "learner.yaml").read_text())
    for block in blocks:
        fragment = yaml.safe_load(block)
        assert isinstance(fragment, dict), block
        if set(fragment) <= actor_fields - {"buffer", "model_path", "run_id", "redis_url"}:
            ActorConfig.model_validate(base_actor | fragment)
        else:
            from offpolicy.learner.config import LearnerConfig

            LearnerConfig.model_validate(base_learner | fragment)


def test_every_command_of_the_verl_page_parses():
    commands = [
        line.strip()
        for kind in ("", "bash")
        for block in doc_blocks(kind)
        for line in block.splitlines()
        if line.strip().startswith("offpolicy ")
    ]
    assert commands
    parser = build_parser()
    for command in commands:
        parser.parse_args(shlex.split(command)[1:])


def test_the_quickstart_commands_of_the_verl_page_fit_80_gib_gpus(tmp_path: Path):
    """Each `offpolicy quickstart` of the page plans its learner within 90 % of an 80 GiB GPU, at the
    figures the page gives; the full weights on one learner GPU are refused at 80 and 141 GiB."""
    from offpolicy.learner.plan.memory import HEADROOM
    from offpolicy.services.quickstart.fit import LearnerPlans, refusal
    from offpolicy.services.quickstart.run import QuickstartOptions

    model = str(write_config(tmp_path / "Qwen2.5-7B-Instruct", QWEN_7B_CONFIG))
    text = " ".join(VERL_DOC.read_text().split())
    commands = [
        shlex.split(line.strip())[1:]
        for block in doc_blocks("bash")
        for line in block.splitlines()
        if line.strip().startswith("offpolicy quickstart ")
    ]
    assert len(commands) == 2
    plans = LearnerPlans(model, int(HEADROOM * 80 * GIB))
    for argv in commands:
        args = build_parser().parse_args(argv)
        assert args.model == "Qwen/Qwen2.5-7B-Instruct"
        split = QuickstartOptions(gpus=tuple(int(g) for g in args.gpus.split(","))).gpu_split()
        assert split is not None
        ranks = len(split[0])
        assert refusal(model, ranks, args.lora, 80) is None, argv
        assert f"{plans.fits(ranks, args.lora):.1f} GiB" in text
    assert refusal(model, 1, False, 80) is not None and refusal(model, 1, False, 141) is not None
    full = plans.settings(1, False).plan
    assert f"plan {full.total / GIB:.1f} GiB (AdamW's fp32 moments alone {full.optimizer / GIB:.1f})" in text


def test_the_settings_map_names_real_fields():
    """Every `here` setting of the map's table is a field of the learner's or the actor's config."""
    from offpolicy.learner.config import LearnerConfig

    rows = [line for line in VERL_DOC.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) >= 10
    for row in rows:
        here = row.split("|")[2]
        for service, path in re.findall(r"(learner|actor) `([\w.]+)`", here):
            model = LearnerConfig if service == "learner" else ActorConfig
            for part in path.split("."):
                assert part in model.model_fields, (service, path)
                annotation = model.model_fields[part].annotation
                model = next(
                    (a for a in getattr(annotation, "__args__", (annotation,)) if hasattr(a, "model_fields")),
                    None,
                )
                if model is None:
                    break


# --- the deploy docs' commands and images


def test_make_images_tags_what_compose_and_the_overlays_pull():
    import subprocess

    out = subprocess.run(
        ["make", "-n", "images", "REGISTRY=reg.example/team", "VERSION=9.9"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for image in ("learner", "actor"):
        assert f"docker push reg.example/team/offpolicy/{image}:9.9" in out
        assert f"-t reg.example/team/offpolicy/{image}:9.9" in out
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert "newName: registry.example.com/team/offpolicy/learner" in deploy


def test_the_learner_image_has_wandb_as_the_extra_pins_it():
    import tomllib

    (spec,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "wandb"
    ]
    dockerfile = (ROOT / "deploy" / "docker" / "learner.Dockerfile").read_text()
    assert dockerfile.count(f'"{spec}"') == 2  # the cpu and the gpu target


def test_the_fill_pod_of_the_deploy_docs_passes_restricted_pod_security():
    """docs/deploy.md's `kubectl run fill --overrides=...`: what the `restricted` profile checks."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    overrides = json.loads(re.search(r"run fill .*?--overrides='(.*?)'", text, re.S).group(1))
    pod = overrides["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    # it mounts every shared claim the actors read from (their model, code and dataset)
    actors = next(
        d for d in kustomize(OVERLAY) if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "actor"
    )
    read = {
        v["persistentVolumeClaim"]["claimName"]
        for v in actors["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    filled = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert {"models", "code", "prompts"} <= read and read - {"hf-cache", "weights"} <= filled


def test_the_deploy_docs_say_the_gpu_overlays_learner_gpus():
    """docs/deploy.md and the gpu overlay's comments name the learner's GPU count that its manifest asks."""
    docs = kustomize("gpu")
    (learner,) = (d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "learner")
    gpus = int(learner["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert f"takes {gpus} GPUs of one node" in (ROOT / "docs" / "deploy.md").read_text()
    comment = (ROOT / "k8s" / "overlays" / "gpu" / "learner-gpu.yaml").read_text().splitlines()[0]
    assert f"on {gpus} GPUs of one node" in comment and f"{gpus} torchrun ranks" in comment
