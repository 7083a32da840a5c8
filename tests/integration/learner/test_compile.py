"""`compile_layers`: the learner with each decoder layer's forward compiled (torch.compile, dynamic shapes)
trains like the eager one on the same ragged packed micro-batches, with and without activation
checkpointing, and its micro-batches of changing lengths reuse a bounded set of graphs instead of compiling
per length."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.model import load_model
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401
from tests.integration.learner.test_packing import train
from tests.unit.learner.rl.test_microbatches import ragged_groups

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_compiled_layers_train_like_eager_ones_without_a_graph_per_length(
    checkpointing,
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
):
    groups = ragged_groups(8, 3, seed=5, prompt=(3, 30), response=(1, 40))
    first = dict(load_model(tiny_dir, "cpu").named_parameters())
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = config(
            tiny_dir, redis_url, tmp_path / str(compiled), groups_per_step=4, mini_batch_groups=2,
            micro_batch_tokens=120, compile_layers=compiled, gradient_checkpointing=checkpointing,
            buffer={"sampler": "fifo", "max_times_sampled": 1}, checkpoint={"checkpoint_dir": None},
            optimizer={"lr": 1e-2},
        )  # fmt: skip
        runs[compiled] = train(cfg, groups)
        graphs = counters["stats"]["unique_graphs"]
    (eager_losses, eager_weights, calls), (losses, weights, _) = runs[False], runs[True]
    assert losses == pytest.approx(eager_losses, abs=1e-5)
    # inductor sums in another order (fp32 noise, ~1e-7 a value); AdamW's normalised steps of lr 1e-2 carry
    # it to ~1e-5 in a weight whose gradient is near zero; the weights move by ~1e-2
    diff = max((eager_weights[n] - weights[n]).abs().max().item() for n in weights)
    moved = max((eager_weights[n] - first[n]).abs().max().item() for n in weights)
    assert diff <= 1e-4 and moved > 100 * diff, f"compiled vs eager weights differ by {diff} ({moved} moved)"
    # every decoder forward of both steps (ragged lengths, the pi_old and the training passes) ran through
    # a bounded set of graphs: the CPU kernel's loop over the lengths runs outside them, cutting the layer
    # in its frames before and after attention, each with its first shape, its dynamic generalisation and
    # its no-grad (pi_old) variant; no graph per length or per number of sequences
    # (tests/unit/learner/model/test_compile_shapes.py: none after the third micro-batch of 12)
    print(f"{calls} decoder forwards, {graphs} graphs, weights {diff:.1e} apart")
    assert calls >= 6 and 1 <= graphs <= 12, (calls, graphs)


def test_the_learner_with_the_cuda_kernel_compiles_its_layers_once_for_a_whole_run(
    tiny_dir,  # noqa: F811
    redis_url,
    tmp_path,
    monkeypatch,
):
    """The GPU's configuration of the compiled row, on CPU: `torch_varlen` (a stand-in operator with
    varlen_attn's signature, tests/unit/learner/model/test_compile_shapes.py), `bf16_mixed`, half the
    layers checkpointed, pi_old and training passes on ragged micro-batches of changing numbers of
    sequences. After the first step no graph is compiled again (dynamo's `eager` backend: the same guards
    as inductor)."""
    import functools

    from offpolicy.learner.model import attention
    from tests.unit.learner.model.test_compile_shapes import stand_in_varlen_attn

    monkeypatch.setattr(attention, "varlen_attn", stand_in_varlen_attn)
    monkeypatch.setattr(attention, "VARLEN_KEYWORDS", frozenset({"scale", "is_causal", "enable_gqa"}))
    monkeypatch.setattr(attention, "resolve", lambda name, device: attention.TORCH_VARLEN)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    groups = ragged_groups(12, 4, seed=8, prompt=(3, 20), response=(1, 100))
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=4, mini_batch_groups=2, micro_batch_tokens=300,
        compile_layers=True, precision="bf16_mixed", gradient_checkpointing=True, checkpoint_layers=1,
        buffer={"sampler": "fifo", "max_times_sampled": 1}, checkpoint={"checkpoint_dir": None},
    )  # fmt: skip
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(groups)
    learner = Learner(cfg)
    counts: list[int] = []
    learner.model.model.layers[0].register_forward_pre_hook(
        lambda m, a, kw: counts.append(len(kw["packed_seq_lens"])), with_kwargs=True
    )
    graphs = []
    try:
        assert learner.model.config._attn_implementation == attention.TORCH_VARLEN
        for _ in range(3):
            learner.step()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        learner.close()
        torch._dynamo.reset()
    print(f"graphs after each step {graphs}; sequences per layer-0 forward {counts}")
    assert len(set(counts)) >= 4  # many numbers of sequences went through the first layer
    assert graphs[0] <= 3 and graphs[-1] == graphs[0], graphs  # grad, no-grad, inference-mode variants
