"""The compose stack as a first run meets it: healthchecks on the interpreter every image has, the set-up
steps naming every secret compose requires, the model fetched once before the services start (the stack's
own checks: test_compose.py)."""

from __future__ import annotations

import re

from tests.unit.deploy.test_compose import BASE, ROOT, SECRETS, base, merged_8gpu, merged_cpu


def test_healthchecks_call_the_interpreter_every_image_has():
    """The vLLM-based GPU images have `python3` and may have no `python` (the slim CPU ones have both): a
    healthcheck on `python` would fail on the GPU learner and leave the actors waiting on it forever."""
    for name, stack in (("base", base()), ("cpu", merged_cpu()), ("8gpu", merged_8gpu())):
        for service, spec in stack["services"].items():
            test = spec.get("healthcheck", {}).get("test", [])
            if any("healthcheck.py" in str(part) for part in test):
                assert test[:2] == ["CMD", "python3"], (name, service, test)
    for dockerfile in (ROOT / "deploy" / "docker").glob("*.Dockerfile"):
        text = dockerfile.read_text()
        gpu = text[text.index(" AS gpu") :]
        assert '["python3", "/usr/local/lib/offpolicy/healthcheck.py"]' in gpu, dockerfile.name


def test_the_readme_and_the_deploy_page_name_every_secret_compose_requires():
    """Compose refuses to start without each of `SECRETS` (`${X:?...}`): the set-up steps say all of them."""
    required = set(re.findall(r"\$\{(\w+):\?", BASE.read_text()))
    assert required == set(SECRETS)
    for doc in (ROOT / "README.md", ROOT / "docs" / "deploy.md"):
        step = next(
            line for line in doc.read_text().splitlines() if "OFFPOLICY_API_TOKEN" in line and "set " in line
        )
        text = doc.read_text()
        around = text[text.index(step) : text.index(step) + 300]
        missing = [s for s in SECRETS if s not in around]
        assert not missing, f"{doc.name}'s set-up step leaves out {missing}"


def test_the_model_is_fetched_once_into_the_cache_the_services_read():
    """model-fetch: the learner's image, `offpolicy fetch-model` on the services' model and token, the
    same hub cache and model folder mounts; on CPU, the tiny model's folder after model-init wrote it."""
    services = base()["services"]
    fetch, learner = services["model-fetch"], services["learner"]
    assert fetch["image"] == learner["image"] and fetch["command"] == ["fetch-model"]
    assert fetch["environment"]["OFFPOLICY_MODEL_PATH"] == learner["environment"]["OFFPOLICY_MODEL_PATH"]
    assert fetch["environment"]["HF_TOKEN"] == learner["environment"]["HF_TOKEN"]
    assert set(fetch["volumes"]) <= set(learner["volumes"]) | set(services["actor"]["volumes"])
    assert "hf-cache:/var/lib/offpolicy/hf-cache" in fetch["volumes"]
    cpu = merged_cpu()["services"]
    assert (
        cpu["model-fetch"]["environment"]["OFFPOLICY_MODEL_PATH"]
        == cpu["learner"]["environment"]["OFFPOLICY_MODEL_PATH"]
    )
    assert cpu["model-fetch"]["depends_on"] == {"model-init": {"condition": "service_completed_successfully"}}
