"""Weights learner -> actors through vLLM's weight-transfer engine (the `gloo` pair), real vLLM on CPU and
real Redis: the learner's `VllmTransport` sends, each actor's `TransferReceiver` receives in its engine.

After an update each engine generates exactly what the engine generates from the same version's file
generation (greedy, same prompts; the log-probs bit for bit), and every token records the version sent.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from actors.config import EngineConfig, SamplingConfig
from actors.engine import VLLMEngine
from actors.transport.receiver import TransferReceiver
from buffer.policy import AsyncPolicyStore, PolicyStore
from buffer.transfer import ActorControl, LearnerControl
from config.transfer import TransferConfig
from learner.model import load_model, make_tiny_model
from learner.model.load import unique_state
from learner.persist.weights import publish_weights
from learner.transport.vllm import VllmTransport

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

GREEDY = SamplingConfig(temperature=1.0, top_k=1, max_tokens=12, n=1)  # greedy
PROMPTS = [[5, 9, 13, 2], [7, 7, 3], [11, 4, 8, 15, 6]]
CFG = TransferConfig(backend="gloo", timeout_s=20.0, heartbeat_s=0.5, bucket_bytes=1 << 20)


@pytest.fixture(scope="module", autouse=True)
def vllm_plugin(tmp_path_factory: pytest.TempPathFactory):
    """The project's `vllm.general_plugins` entry point (pyproject.toml), visible to every process vLLM
    starts. An install made before the entry point existed lacks it: then a dist-info declaring the same
    entry point is put on PYTHONPATH for this module (with this checkout first, so the engine-core
    process imports this code)."""
    import os
    import sys
    from importlib.metadata import entry_points

    if any(e.value == "actors.transport.plugin:register" for e in entry_points(group="vllm.general_plugins")):
        yield
        return
    root = tmp_path_factory.mktemp("plugin")
    info = root / "offpolicy_vllm_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: offpolicy-vllm-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\noffpolicy = actors.transport.plugin:register\n"
    )
    repo = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([repo, str(root)] + ([old] if old else []))
    sys.path.insert(0, str(root))
    yield
    sys.path.remove(str(root))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engines(model_dir: Path):
    engs = [VLLMEngine(EngineConfig.cpu_tiny(str(model_dir), max_model_len=256), transfer_backend="gloo")]
    yield engs
    for e in engs:
        e.shutdown()


def _perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    model = load_model(model_dir, "cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in unique_state(model).values():
            if t.is_floating_point():
                t.add_(0.05 * torch.randn(t.shape, generator=g))
    return model


def _generate(engine: VLLMEngine):
    outs = engine.generate(PROMPTS, GREEDY)
    return [(o[0].token_ids.tolist(), o[0].logprobs, o[0].versions) for o in outs]


def _start_receiver(engine, redis_url, run_id, actor_id):
    store = AsyncPolicyStore(redis_url, run_id)
    control = ActorControl(redis_url, run_id, actor_id)
    receiver = TransferReceiver(control, engine, store, CFG, CollectorRegistry())

    async def start():
        return asyncio.get_running_loop().create_task(receiver.run())

    task = engine.call(start())
    return receiver, task


def _stop_receiver(engine, task) -> None:
    async def stop():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    engine.call(stop())


def _wait_members(control: LearnerControl, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(control.members()) < n:
        assert time.monotonic() < deadline, f"{len(control.members())} of {n} members announced"
        time.sleep(0.1)


def test_transfer_gives_the_engine_exactly_the_files_weights(engines, model_dir, tmp_path, redis_url, run_id):
    engine = engines[0]
    before = _generate(engine)
    model = _perturbed(model_dir, seed=1)
    store = PolicyStore(redis_url, run_id)
    record = publish_weights(model, tmp_path / "weights", 1, store=store, dtype=torch.float32)
    control = LearnerControl(redis_url, run_id)
    receiver, task = _start_receiver(engine, redis_url, run_id, "actor-0")
    transport = VllmTransport(CFG, control, lambda: unique_state(model), torch.float32)
    try:
        _wait_members(control, 1)
        result = transport.send(1)
        assert result.ok, result.error
        assert (result.version, result.group_size) == (1, 1)
        assert result.bytes >= sum(t.numel() * 4 for t in unique_state(model).values())
        assert engine.loaded_version == 1 and receiver.received == 1
        sent = _generate(engine)

        # the same version from its files, into the same engine
        async def load():
            async with engine.paused():
                await engine.reload_weights(record.weights_uri, 1)

        engine.call(load())
        from_files = _generate(engine)
    finally:
        _stop_receiver(engine, task)
        transport.close()
        control.close()
        store.close()
    assert [s[0] for s in sent] != [b[0] for b in before], "the perturbed weights must change the output"
    for (ids, lps, versions), (f_ids, f_lps, _) in zip(sent, from_files, strict=True):
        assert ids == f_ids
        np.testing.assert_array_equal(lps, f_lps)
        assert versions is not None and (versions == 1).all()
