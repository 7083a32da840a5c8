"""A LoRA learner on the tiny model and the embedded Redis: it trains its adapter alone (the base stays the
checkpoint's), with the KL loss against the base model (the adapter disabled, no second copy); its
checkpoints hold the adapter and AdamW state without the base weights, and a resumed learner holds the same
adapter and optimizer state; a full-weight learner refuses its checkpoint. On 2 ranks (torchrun, FSDP2,
gloo) a lean start and an eager one hold exactly the one-process tensors on every rank, and the learner
trains like one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.build import build_trainables
from offpolicy.learner.distributed.ranks import SINGLE
from offpolicy.learner.errors import CheckpointMismatch
from offpolicy.learner.model import Precision, load_model, lora
from offpolicy.learner.persist.checkpoint import checkpoint_versions
from offpolicy.learner.persist.dcp import load_sharded
from offpolicy.learner.trainer import Learner
from tests.integration.learner.distributed.test_fsdp import groups, make_config, tiny2, torchrun  # noqa: F401 (fixtures)
from tests.integration.learner.distributed.torchrun import run_script
from tests.integration.learner.test_loop import config

pytestmark = pytest.mark.redis
LORA = {"rank": 4, "alpha": 8.0}
TOLERANCE = 1e-5  # fp32; the two runs sum the same terms in another order


def adapter_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if lora.is_adapter_name(n)}


def moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """AdamW's state tensors in parameter order (step, exp_avg, exp_avg_sq of each)."""
    state = opt.state_dict()["state"]
    return [state[i][k] for i in sorted(state) for k in ("step", "exp_avg", "exp_avg_sq")]


def test_a_lora_learner_trains_checkpoints_and_resumes_its_adapter(tiny2, groups, redis_url, tmp_path):  # noqa: F811
    cfg = config(
        tiny2, redis_url, tmp_path, lora=LORA, kl_loss_coef=0.5, optimizer={"lr": 1e-2},
        metrics_jsonl=str(tmp_path / "m.jsonl"),
    )  # fmt: skip
    with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)  # rewards that vary within each group: the adapter has gradients
    base = load_model(tiny2, "cpu").state_dict()
    learner = Learner(cfg)
    try:
        start = adapter_of(learner.model)
        for _ in range(2):  # checkpoint_every=2: the checkpoint holds the state after the second step
            learner.step()
        trained, state = adapter_of(learner.model), moments(learner.optimizer)
        for name, p in learner.model.named_parameters():
            if not lora.is_adapter_name(name):  # the base is the checkpoint's, untouched
                assert torch.equal(p, base[lora.base_name(name)]), name
        assert learner.reference is not None and list(learner.reference.parameters()) == []
    finally:
        learner.close()
    assert any(not torch.equal(trained[n], start[n]) for n in trained if ".lora_B." in n)
    assert any(not torch.equal(trained[n], start[n]) for n in trained if ".lora_A." in n)
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # version 0 is the base model
    assert lines[1]["actor/kl_loss"] > 1e-6  # the adapter moved away from the base (the reference)

    assert checkpoint_versions(cfg.checkpoint_path) == [2]
    ckpt = cfg.checkpoint_path / "ckpt-0000000002"
    assert set(load_file(str(ckpt / "model.safetensors"))) == set(trained)  # no base weight in it
    assert json.loads((ckpt / "meta.json").read_text())["lora"] is True
    (weights,) = Path(tiny2).glob("*.safetensors")
    assert (ckpt / "model.safetensors").stat().st_size * 5 < weights.stat().st_size

    resumed = Learner(cfg)
    try:
        assert resumed.version == 2
        got = adapter_of(resumed.model)
        assert all(torch.equal(got[n], t) for n, t in trained.items())
        assert all(torch.equal(a, b) for a, b in zip(moments(resumed.optimizer), state, strict=True))
        resumed.step()  # and trains on
        assert resumed.version == 3
    finally:
        resumed.close()
    full = cfg.model_copy(update={"lora": None})
    with pytest.raises(CheckpointMismatch, match="LoRA adapter"):
        Learner(full).close()


@pytest.mark.slow
def test_lora_ranks_hold_the_one_process_tensors_lean_or_not(tiny2):  # noqa: F811
    out = Path(tiny2).parent / "lora_ranks"
    run_script("lora_ranks.py", str(tiny2), str(out))
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for got in results:
        for case, way in (("lean", "slices"), ("lean, broadcast", "broadcast"), ("eager", "whole, sharded")):
            r = got[case]
            assert r["way"] == way and r["publish_keys_are_the_adapter"] and r["trainable_is_the_adapter"]
            assert r["adamw_params"] == r["adapter_params"] > 0
            assert r["start_diff"] == 0.0  # base slices and seeded factors: exactly the one-process tensors
            assert r["trained_diff"] <= TOLERANCE, r["top"]
            assert r["adapter_moved"] > 100 * TOLERANCE
            assert r["ref_vs_base"] <= 1e-6 and r["policy_vs_base"] > 1e-2  # the reference is the base
        mixed = got["bf16_mixed"]  # the CUDA default: a bf16 frozen base beside fp32 adapter masters
        assert mixed["base_dtypes"] == ["torch.bfloat16"] and mixed["adapter_dtypes"] == ["torch.float32"]
        assert mixed["base_unchanged"] and mixed["adapter_moved"] > 100 * TOLERANCE
    assert results[0] == {**results[1], "rank": 0}  # every rank the same numbers


@pytest.mark.slow
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "eager"])
def test_two_lora_ranks_train_like_one_process(lean, tiny2, groups, redis_url, tmp_path):  # noqa: F811
    """2 learner steps of 2 optimizer steps with the KL loss against the adapter-off base: the 2-rank run's
    sharded checkpoint (v4) holds the one-process adapter and AdamW state, and their losses agree."""
    kw = {"lora": LORA, "kl_loss_coef": 0.5, "optimizer": {"lr": 1e-3}, "max_steps": 2}
    one = make_config(tiny2, redis_url, tmp_path, "one", **kw)
    two = make_config(tiny2, redis_url, tmp_path, "two", **kw, fsdp={"lean_start": lean})
    for cfg in (one, two):
        with ReplayBuffer(redis_url, cfg.run_id, cfg.buffer) as buf:
            buf.insert_many(groups)
    learner = Learner(one)
    try:
        for _ in range(2):
            learner.step()
        want, state = adapter_of(learner.model), moments(learner.optimizer)
    finally:
        learner.close()
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(two.model_dump(mode="json")))
    log = tmp_path / "two.log"
    assert torchrun(2, tmp_path / "two.yaml", log) == 0, log.read_text()[-4000:]
    assert checkpoint_versions(two.checkpoint_path) == [4]
    # the sharded checkpoint read back into one process (DCP reshards): the adapter and AdamW state
    cpu = torch.device("cpu")
    parts, _, _ = build_trainables(two, cpu, Precision.resolve("fp32", cpu), False)
    load_sharded(two.checkpoint_path / "ckpt-0000000004", parts, SINGLE)
    got = adapter_of(parts.model)
    assert got.keys() == want.keys()
    diffs = {n: float((got[n] - t).abs().max()) for n, t in want.items()}
    assert max(diffs.values()) <= TOLERANCE, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    moved = max(float((t - lora.initial_factor(n, t.shape, one.seed)).abs().max()) for n, t in want.items())
    assert moved > 20 * TOLERANCE
    got_state = moments(parts.optimizer)
    assert len(got_state) == len(state)
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-9) for a, b in zip(got_state, state, strict=True))
    lines = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("one", "two")
    }
    for key in ("actor/kl_loss", "actor/pg_loss", "loss"):
        want_line = [m[key] for m in lines["one"]]
        assert [m[key] for m in lines["two"]] == pytest.approx(want_line, rel=1e-4, abs=1e-7), key
    assert lines["one"][-1]["actor/kl_loss"] > 0
