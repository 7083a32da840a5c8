"""The KL-to-reference loss and the entropy bonus: verl 0.9.1's `kl_penalty` and `entropy_from_logits` on
the same random inputs (values and gradients, every KL type), the chunked entropy of the policy's forward
against the full logits at each row's temperature (packed and padded), the loss terms as verl's actor
composes them, environment tokens and padding contributing nothing, the config and the memory plan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from offpolicy.learner.batch import collate
from offpolicy.learner.config import LearnerConfig, frozen_field_changes
from offpolicy.learner.errors import MemoryPlanError
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.load import load_model
from offpolicy.learner.model.policy import entropy_from_logits, token_stats
from offpolicy.learner.plan.memory import GIB, ModelShape, check, estimate
from offpolicy.learner.rl.losses import aggregate_loss, kl_penalty
from offpolicy.learner.rl.update import policy_loss_terms
from tests.unit.learner.rl.test_microbatches import ragged_groups
from tests.unit.learner.test_memory_plan import QWEN_7B
from verl_oracle import load_verl

ORACLE = load_verl()
needs_verl = pytest.mark.skipif(ORACLE is None, reason="verl==0.9.1 is not installed (pip install --no-deps)")
KL_TYPES = ["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]
KL_TYPES_ALL = KL_TYPES + [k + "+" for k in KL_TYPES]


def log_probs(seed: int, b: int = 6, t: int = 20, scale: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy, reference) log-probs of the same tokens, some far apart (k3's clamps are reached)."""
    gen = torch.Generator().manual_seed(seed)
    ref = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 4
    pol = ref + scale * torch.randn(b, t, generator=gen, dtype=torch.float64)
    pol[0, :3] = torch.tensor([-30.0, 25.0, -12.0], dtype=torch.float64)  # |log ratio| past 20 and 10
    return pol, ref


@needs_verl
@pytest.mark.parametrize("kind", KL_TYPES_ALL)
def test_kl_penalty_matches_verl_values_and_gradients(kind):
    assert ORACLE is not None
    pol, ref = log_probs(3)
    ours_in, theirs_in = pol.clone().requires_grad_(), pol.clone().requires_grad_()
    ours = kl_penalty(ours_in, ref, kind)
    theirs = ORACLE.core_algos.kl_penalty(theirs_in, ref, kind)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    w = torch.randn(pol.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=0, atol=0)


def test_aliases_and_straight_through_behave_as_documented():
    pol, ref = log_probs(4)
    for alias, name in (("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")):
        assert torch.equal(kl_penalty(pol, ref, alias), kl_penalty(pol, ref, name))
    x = pol.clone().requires_grad_()
    k3p = kl_penalty(x, ref, "k3+")
    assert torch.equal(k3p.detach(), kl_penalty(pol, ref, "k3"))  # k3's value
    k3p.sum().backward()
    torch.testing.assert_close(x.grad, pol - ref)  # k2's gradient: d/dx (x - ref)^2 / 2


@needs_verl
def test_entropy_matches_verl_values_and_gradients():
    assert ORACLE is not None
    gen = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(7, 9, 301, generator=gen, dtype=torch.float64)
    logits[0, 0] = -1e4  # a flat row
    logits[0, 1, 3] = 60.0  # a near one-hot row
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours, theirs = entropy_from_logits(a), ORACLE.verl_f.entropy_from_logits(b)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-8)  # the flat row: lse - E[z] at 1e4
    w = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-9)  # the flat row: 0 up to 3e-11
    assert torch.autograd.gradcheck(entropy_from_logits, (logits[1:3, :2, :40].clone().requires_grad_(),))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=64, num_heads=1, num_layers=2)
    return load_model(path, "cpu")


@pytest.mark.parametrize("packed", [False, True])
def test_the_forward_gives_the_entropy_of_the_tempered_logits_at_each_trained_token(tiny, packed):
    """Chunked (3 tokens a chunk) from the sampled tokens' states = verl's formula on the full logits / T
    of a plain per-row forward; 0 on padding and environment tokens; gradients flow."""
    groups = ragged_groups(3, 2, seed=2)
    t = max((t for g in groups for t in g.trajectories), key=lambda t: len(t.response_ids))
    t.policy_mask = np.arange(len(t.response_ids)) % 3 != 1  # every third token the environment's
    batch = collate(groups, pad_token_id=0)
    lp, ent = token_stats(tiny, batch, chunk_tokens=3, packed=packed, entropy=True)
    assert ent is not None and ent.requires_grad
    P = batch.prompt_width
    for row in range(batch.num_rows):
        real = batch.attention_mask[row].bool()
        with torch.no_grad():
            logits = tiny(input_ids=batch.input_ids[row][real][None]).logits[0].float()  # (L, V)
        start = int((~real[:P]).sum())  # left padding
        R = int(real[P:].sum())
        want = verl_entropy(logits[P - start - 1 : P - start - 1 + R] / batch.temperatures[row])
        mask = batch.response_mask[row, :R]
        torch.testing.assert_close(ent[row, :R].detach(), want * mask, rtol=1e-5, atol=1e-5)
        assert (ent[row, R:] == 0).all()
    assert (ent[batch.response_mask == 0] == 0).all()  # environment tokens and padding: nothing
    (ent.sum() + lp.sum()).backward()
    assert tiny.lm_head.weight.grad is not None and tiny.lm_head.weight.grad.abs().sum() > 0
    tiny.zero_grad(set_to_none=True)


def verl_entropy(logits: torch.Tensor) -> torch.Tensor:
    if ORACLE is not None:
        return ORACLE.verl_f.entropy_from_logits(logits)
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


@needs_verl
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_loss_terms_compose_as_verls_actor(mode):
    """`pg_loss - entropy_coeff * entropy_loss + kl_loss_coef * kl_loss`, each aggregated by verl's
    agg_loss over the same response mask (verl/workers/utils/losses.py `ppo_loss`)."""
    assert ORACLE is not None
    pol, ref = (t.float() for t in log_probs(6))
    gen = torch.Generator().manual_seed(7)
    mask = (torch.rand(pol.shape, generator=gen) > 0.3).float()
    ent = torch.rand(pol.shape, generator=gen) * 3
    mb = dataclasses.make_dataclass("Mb", ["old_log_probs", "advantages", "response_mask", "is_weights",
                                           "behavior_logprobs", "ref_log_probs"])(
        pol + 0.1, torch.randn(pol.shape, generator=gen), mask, None, pol + 0.1, ref,
    )  # fmt: skip
    cfg = LearnerConfig(
        model_path="unused", loss_agg_mode=mode, kl_loss_coef=0.3, kl_loss_type="k3", entropy_coeff=0.01
    )
    den = {"tokens": None, "rows": None, "width": None}
    loss, _, terms = policy_loss_terms(pol, ent, mb, cfg, den)
    agg = ORACLE.core_algos.agg_loss
    kl = agg(ORACLE.core_algos.kl_penalty(pol, ref, "k3"), mask, mode)
    entropy = agg(ent, mask, mode)
    assert terms["actor/kl_loss"].item() == pytest.approx(kl.item(), rel=1e-6)
    assert terms["actor/entropy"].item() == pytest.approx(entropy.item(), rel=1e-6)
    want = terms["actor/pg_loss"] - 0.01 * entropy + 0.3 * kl
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)


def test_masked_tokens_contribute_nothing():
    """A token outside the response mask (environment, padding, rejected) may hold anything: the terms
    are those of the masked tokens alone."""
    pol, ref = log_probs(8)
    mask = torch.ones(pol.shape)
    mask[:, -5:] = 0
    garbage_pol, garbage_ref = pol.clone(), ref.clone()
    garbage_pol[:, -5:], garbage_ref[:, -5:] = 50.0, -80.0
    for kind in KL_TYPES_ALL:
        a = aggregate_loss(kl_penalty(pol, ref, kind), mask, "token-mean")
        b = aggregate_loss(kl_penalty(garbage_pol, garbage_ref, kind), mask, "token-mean")
        assert a.item() == pytest.approx(b.item(), rel=1e-12), kind


# --- config and memory plan


def test_kl_config_takes_verls_names_and_refuses_full_naming_the_field():
    for kind in KL_TYPES_ALL:
        assert LearnerConfig(model_path="m", kl_loss_type=kind).kl_loss_type == kind
    assert LearnerConfig(model_path="m").kl_loss_type == "low_var_kl"  # verl's default
    with pytest.raises(ValidationError, match=r"kl_loss_type[\s\S]*NotImplementedError"):
        LearnerConfig(model_path="m", kl_loss_type="full")
    with pytest.raises(ValidationError, match="kl_loss_type"):
        LearnerConfig(model_path="m", kl_loss_type="k4")
    for field, value in (("kl_loss_coef", -0.1), ("entropy_coeff", -1.0)):
        with pytest.raises(ValidationError, match=field):
            LearnerConfig(model_path="m", **{field: value})
    with pytest.raises(ValidationError, match=r"reference\.model_pth"):
        LearnerConfig(model_path="m", reference={"model_pth": "x"})


def test_the_reference_cannot_appear_or_vanish_while_running():
    off = LearnerConfig(model_path="m")
    on = off.model_copy(update={"kl_loss_coef": 0.1})
    assert frozen_field_changes(off, on) == ["kl_loss_coef"]
    assert frozen_field_changes(on, on.model_copy(update={"kl_loss_coef": 0.2})) == []
    moved = LearnerConfig(model_path="m", kl_loss_coef=0.1, reference={"model_path": "other"})
    assert frozen_field_changes(on, moved) == ["reference.model_path"]


def test_the_memory_plan_counts_the_reference_only_with_the_kl_loss():
    shape = ModelShape.of(QWEN_7B)
    off = estimate(LearnerConfig(model_path="m"), shape, 8, True, True, True)
    on = estimate(LearnerConfig(model_path="m", kl_loss_coef=0.1), shape, 8, True, True, True)
    assert off.reference == 0 and on.reference == 2 * shape.params // 8  # bf16, an eighth per rank
    assert on.total - off.total == on.reference
    one = estimate(LearnerConfig(model_path="m", kl_loss_coef=0.1), shape, 1, False, True, True)
    assert one.reference == 2 * shape.params
    with pytest.raises(MemoryPlanError, match=r"reference takes 14\.2: set reference\.cpu_offload: true"):
        check(one, 80 * GIB, LearnerConfig(model_path="m", kl_loss_coef=0.1), 1, True)
    offload = LearnerConfig(model_path="m", kl_loss_coef=0.1, reference={"cpu_offload": True})
    streamed = estimate(offload, shape, 1, False, True, True)
    assert streamed.reference == 2 * 2 * shape.vocab * shape.hidden  # embeddings and LM head stay
    assert streamed.host_offloaded == 2 * shape.params
    sharded = estimate(offload, shape, 8, True, True, True)
    assert sharded.reference == 0 and sharded.host_offloaded == 2 * shape.params // 8
    fp32 = estimate(
        LearnerConfig(model_path="m", kl_loss_coef=0.1, precision="fp32"), shape, 1, False, True, True
    )
    assert fp32.reference == 4 * shape.params
    bonus = estimate(LearnerConfig(model_path="m", entropy_coeff=0.01), shape, 8, True, True, True)
    assert bonus.lm_head_chunk == off.lm_head_chunk  # the fused head's entropy comes from the same pass
    chunked = LearnerConfig(model_path="m", logprob_head="chunked")
    plain = estimate(chunked, shape, 8, True, True, True)
    bonus = estimate(chunked.model_copy(update={"entropy_coeff": 0.01}), shape, 8, True, True, True)
    assert bonus.lm_head_chunk == plain.lm_head_chunk * 4 // 3  # one more fp32 chunk: the entropy's gradient


def test_streamed_layers_compute_the_same_log_probs_and_go_back_to_host_memory(tiny):
    """`reference.cpu_offload` on one process: each decoder layer's weights get device copies for its own
    forward only (on CPU the copy is the host tensor itself: the hooks' bookkeeping is what is checked)."""
    import copy

    from offpolicy.learner.distributed.fsdp import decoder_layers
    from offpolicy.learner.model.policy import token_logprobs
    from offpolicy.learner.model.reference import freeze, stream_layers

    model = freeze(copy.deepcopy(tiny))
    batch = collate(ragged_groups(2, 2, seed=4), pad_token_id=0)
    with torch.no_grad():
        want = token_logprobs(model, batch)
        layers = decoder_layers(model, 2)
        stream_layers(model, layers, torch.device("cpu"))
        host = [p.data_ptr() for p in layers.parameters()]
        got = token_logprobs(model, batch)
    assert torch.equal(got, want)
    assert [p.data_ptr() for p in layers.parameters()] == host
