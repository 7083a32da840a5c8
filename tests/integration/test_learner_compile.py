"""`compile_layers`: the learner with each decoder layer's forward compiled (torch.compile, dynamic shapes)
trains like the eager one on the same ragged packed micro-batches, with and without activation
checkpointing, and its micro-batches of changing lengths reuse a bounded set of graphs instead of compiling
per length."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from offpolicy.learner.model import load_model
from tests.integration.test_learner_loop import config, tiny_dir  # noqa: F401
from tests.integration.test_learner_packing import train
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
