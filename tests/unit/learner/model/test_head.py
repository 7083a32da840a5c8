"""The fused log-prob head against the earlier chunked one, on CPU: the same log-probs, entropies and
gradients (hidden states, LM head weight) in fp32 and under bf16 autocast, at several temperatures, with
soft-capping and the entropy; and through the whole policy forward, packed and padded."""

from __future__ import annotations

import pytest
import torch

from offpolicy.learner.batch import collate
from offpolicy.learner.model import load_model, make_tiny_model
from offpolicy.learner.model.head import _backward_pass, _forward_pass, head_logprobs
from offpolicy.learner.model.policy import _chunk_stats, token_stats
from tests.unit.learner.rl.test_microbatches import ragged_groups


def run_head(fused: bool, head, h, ids, temps, softcap, entropy, autocast):
    """Log-probs, entropies and the gradients of a weighted sum of both, through one head."""
    head.zero_grad(set_to_none=True)
    h = h.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if fused:
            lp, ent = head_logprobs(head, h, ids, temps, softcap, entropy)
        else:
            lp, ent = _chunk_stats(head, softcap, h, ids, temps, entropy)
    w = torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)
    loss = (lp * w).sum() + ((ent * w.flip(-1)).sum() if entropy else 0.0)
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), h.grad, head.weight.grad, head.bias.grad


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("entropy", [False, True])
def test_the_fused_head_equals_the_chunked_one(autocast, softcap, entropy):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 503)
    torch.nn.init.normal_(head.weight, std=0.5, generator=gen)
    h = torch.randn(3, 11, 32, generator=gen)  # (b, c, H): padded layout chunks
    ids = torch.randint(0, 503, (3, 11), generator=gen)
    temps = torch.tensor([1.0, 0.7, 1.3])[:, None, None]  # (b, 1, 1)
    fused = run_head(True, head, h, ids, temps, softcap, entropy, autocast)
    chunked = run_head(False, head, h, ids, temps, softcap, entropy, autocast)
    assert torch.equal(fused[0], chunked[0])  # the same fp32 ops on the same logits: bit for bit
    if entropy:
        torch.testing.assert_close(fused[1], chunked[1], rtol=0, atol=1e-6)
    tol = 1e-2 if autocast else 1e-5  # bf16 matmuls of the logits' gradient
    for a, b in zip(fused[2:], chunked[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_logits_gradient_is_the_analytic_one_in_float64():
    """dL/dz of both passes against autograd through log_softmax and the entropy formula (float64)."""
    gen = torch.Generator().manual_seed(1)
    z = 3 * torch.randn(5, 40, generator=gen, dtype=torch.float64)
    ids, temps = torch.randint(0, 40, (5,), generator=gen), torch.rand(5, 1, generator=gen) + 0.5
    g_lp, g_ent = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    x = z.clone().requires_grad_()
    y = (2.0 * torch.tanh(x / 2.0)) / temps
    logp = torch.log_softmax(y, -1)
    ent = -(logp.exp() * logp).sum(-1)
    ((logp.gather(-1, ids[:, None])[:, 0] * g_lp).sum() + (ent * g_ent).sum()).backward()
    _, lse, h = _forward_pass(z, ids, temps.double(), 2.0, True)
    torch.testing.assert_close(h, ent.detach())
    grad = _backward_pass(z, ids, temps.double(), 2.0, lse, h, g_lp.double(), g_ent.double())
    torch.testing.assert_close(grad, x.grad)


@pytest.mark.parametrize("packed", [False, True])
def test_the_policy_forward_with_either_head_gives_the_same_numbers(tmp_path, packed):
    model = load_model(make_tiny_model(tmp_path / "m", hidden_size=64, num_heads=1), "cpu")
    batch = collate(ragged_groups(3, 2, seed=7), pad_token_id=0)
    out = {}
    for head in ("fused", "chunked"):
        model.zero_grad(set_to_none=True)
        lp, ent = token_stats(model, batch, chunk_tokens=5, packed=packed, entropy=True, head=head)
        (lp.sum() + 0.1 * ent.sum()).backward()
        out[head] = (lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()])
    assert torch.equal(out["fused"][0], out["chunked"][0])
    torch.testing.assert_close(out["fused"][1], out["chunked"][1], rtol=0, atol=1e-6)
    for a, b in zip(out["fused"][2], out["chunked"][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fp32 sums, any thread order
