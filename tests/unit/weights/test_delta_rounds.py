"""Delta rounds of the broadcast transfer engine (weights/engines/delta_rounds.py): the learner's encoding, a
worker's apply, and the gloo worker's checks (its group replaced by a recording one)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from offpolicy.weights.engines.delta_rounds import (
    DENSE,
    DeltaSends,
    RoundBase,
    RoundMismatch,
    bit_view,
    crc32,
    round_bytes,
)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (0.02 * torch.randn(64, 32, generator=g)).to(torch.bfloat16),
        "layer.q.weight": (0.02 * torch.randn(32, 32, generator=g)).to(torch.bfloat16),
        "layer.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "lm_head.bias": torch.zeros(7, dtype=torch.float32),
    }


def _step(w: dict[str, torch.Tensor], seed: int, share: float) -> dict[str, torch.Tensor]:
    """About `share` of each tensor's values moved (as an RL step rounds a few values anew)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in w.items():
        hit = torch.rand(t.shape, generator=g) < share
        moved = t.float() + 0.01 * torch.randn(t.shape, generator=g)
        out[name] = torch.where(hit, moved, t.float()).to(t.dtype)
    return out


def _full(sends: DeltaSends, w: dict[str, torch.Tensor]) -> int:
    return round_bytes([t.shape for t in w.values()], [t.dtype for t in w.values()])


def test_fifty_delta_rounds_apply_bit_for_bit_with_nan_and_signed_zeros():
    sends, worker = DeltaSends("on", full_every=100, share=1.0), RoundBase()
    w = _weights()
    for name, t in sends.base.keep_all(iter(w.items())):  # the first round: whole, kept on both sides
        worker.put(name, t)
    sends.commit(sends.next_round(), "full", 0, _full(sends, w))
    worker.round = sends.round
    shares = []
    for version in range(2, 52):  # 50 delta rounds
        w = _step(w, version, 0.01)
        if version == 5:  # bit patterns, not numbers: NaN, -0.0 over +0.0, an infinity
            w["layer.norm.weight"][:3] = torch.tensor([float("nan"), -0.0, float("inf")])
            w["lm_head.bias"][0] = -0.0
        assert sends.wants_delta()
        patches = sends.encode(iter(w.items()), _full(sends, w))
        assert patches is not None
        for p in patches:
            worker.apply(p.name, p.count, p.payload)
            assert crc32(worker.tensors[p.name]) == p.crc
        sent = sum(p.payload.numel() for p in patches)
        shares.append(sent / _full(sends, w))
        sends.commit(sends.next_round(), "delta", sent, _full(sends, w))
        for name, t in w.items():
            assert torch.equal(bit_view(worker.tensors[name]), bit_view(t)), (version, name)
            assert torch.equal(bit_view(sends.base.tensors[name]), bit_view(t))
    assert max(shares) < 0.1, shares  # 1 % changed: 6 B per changed bf16 value (8 for fp32) of 2 (4)


def test_a_tensor_mostly_changed_goes_whole_and_the_share_or_a_new_tensor_sends_the_round_whole():
    sends = DeltaSends("auto", full_every=100, share=0.05)
    w = _weights()
    list(sends.base.keep_all(iter(w.items())))
    sends.commit(sends.next_round(), "full", 0, _full(sends, w))
    moved = _step(w, 1, 0.0)
    moved["layer.q.weight"] = _step({"q": w["layer.q.weight"]}, 2, 0.9)["q"]  # 90 % changed: whole is smaller
    patches = sends.encode(iter(moved.items()), 10**9)  # a limit it cannot pass
    assert patches is not None
    counts = {p.name: p.count for p in patches}
    assert counts["layer.q.weight"] == DENSE and counts["embed.weight"] == 0, counts
    assert next(p for p in patches if p.name == "embed.weight").payload.numel() == 0
    again = _step(moved, 3, 0.9)
    assert sends.encode(iter(again.items()), _full(sends, w)) is None  # past 5 % of a full round
    grown = dict(_step(again, 4, 0.001), extra=torch.zeros(3))
    assert sends.encode(iter(grown.items()), _full(sends, w)) is None  # the base lacks a tensor


def test_every_full_every_th_round_goes_whole():
    sends = DeltaSends("on", full_every=3, share=1.0)
    kinds = []
    w = _weights()
    for version in range(1, 8):
        w = _step(w, version, 0.01)
        delta = sends.encode(iter(w.items()), _full(sends, w)) if sends.wants_delta() else None
        if delta is None:
            list(sends.base.keep_all(iter(w.items())))
        kind = "full" if delta is None else "delta"
        sends.commit(sends.next_round(), kind, 0, 0)
        kinds.append(kind)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    sends.drop()  # a failed send or a new group: the next round is whole
    assert not sends.wants_delta()


BUCKET = 128


class _Group:
    """Stands in for the gloo group: each broadcast fills the receiver's buffer with the next bucket."""

    def __init__(self, packed: list[torch.Tensor]) -> None:
        self.packed, self.taken = list(packed), 0

    def broadcast(self, tensors, opts):
        tensors[0].copy_(self.packed[self.taken])
        self.taken += 1
        return self

    def wait(self) -> None:
        pass


class _Model:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, pairs):
        self.loaded.update((n, t.clone()) for n, t in pairs)


def _worker(base: RoundBase, packed: list[torch.Tensor]):
    pytest.importorskip("vllm")
    from offpolicy.weights.engines.gloo import GlooWeightTransferEngine

    engine = object.__new__(GlooWeightTransferEngine)
    engine.group, engine.model, engine.device = _Group(packed), _Model(), torch.device("cpu")
    engine.bucket_bytes, engine.base = BUCKET, base
    return engine


def _round(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], base_round: int):
    from offpolicy.weights.engines.gloo import GlooWeightTransferUpdateInfo, buckets

    sends = DeltaSends("on", 100, 1.0)
    list(sends.base.keep_all(iter(old.items())))
    patches = sends.encode(iter(new.items()), 10**9)
    info = GlooWeightTransferUpdateInfo(
        names=list(new), dtype_names=[str(t.dtype).removeprefix("torch.") for t in new.values()],
        shapes=[list(t.shape) for t in new.values()], round=base_round + 1, base_round=base_round,
        counts=[p.count for p in patches], crcs=[p.crc for p in patches],
    )  # fmt: skip
    sizes = [p.payload.numel() for p in patches]
    packed = [torch.cat([p.payload for p in patches[a:b]]) for a, b in buckets(sizes, BUCKET)]
    return info, packed


def test_the_gloo_worker_applies_a_round_on_its_base_and_loads_the_whole_version():
    old, new = _weights(), _step(_weights(), 1, 0.02)
    info, packed = _round(old, new, base_round=4)
    assert len(packed) > 1  # several buckets
    base = RoundBase()
    for n, t in old.items():
        base.put(n, t)
    base.round = 4
    engine = _worker(base, packed)
    engine.receive_weights(info)
    assert engine.group.taken == len(packed) and base.round == 5
    assert {n: bit_view(t).tolist() for n, t in engine.model.loaded.items()} == {
        n: bit_view(t).tolist() for n, t in new.items()
    }


@pytest.mark.parametrize("case", ["another round", "corrupted", "no base"])
def test_the_gloo_worker_refuses_a_round_it_cannot_apply_loads_nothing_and_drops_its_base(case):
    old, new = _weights(), _step(_weights(), 1, 0.02)
    info, packed = _round(old, new, base_round=4)
    base = RoundBase()
    for n, t in old.items():
        base.put(n, t)
    base.round = {"another round": 3, "corrupted": 4, "no base": None}[case]
    if case == "corrupted":
        packed[0][-1] ^= 0xFF
    engine = _worker(base, packed)
    with pytest.raises(RoundMismatch):
        engine.receive_weights(info)
    assert engine.group.taken == len(packed), "every bucket is received: the broadcast stays in step"
    assert engine.model.loaded == {} and base.round is None


def test_update_info_of_a_delta_round_names_its_base_and_a_count_and_crc_per_tensor():
    pytest.importorskip("vllm")
    from offpolicy.weights.engines.gloo import GlooWeightTransferUpdateInfo

    info = GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["bfloat16"], shapes=[[2]])
    assert asdict(info)["counts"] is None and info.round == 0 and not info.keep
    with pytest.raises(ValueError, match="base_round"):
        GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["bf16"], shapes=[[2]], counts=[1], crcs=[1])
