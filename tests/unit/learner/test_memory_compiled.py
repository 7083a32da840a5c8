"""The memory plan's count for decoder layers under `compile_layers` (plan/memory.py `layer_bytes(...,
compiled=True)`): what the forward graph inductor's partitioner makes keeps for the backward pass, per
token, at the real widths of the GPU benchmark's two shapes, equals the count; and `auto` spends the room
this frees on fewer checkpointed layers.

The graph is read, not run: dynamo traces one decoder layer with dynamic shapes (as `compile_layers` does)
and hands it to AOTAutograd with inductor's decompositions and its min-cut partitioner, then to a compiler
that reads the forward graph's saved outputs and stops (no code generated, no 4B-wide product computed).
Per token is the difference between 8,192 and 4,096 tokens (the bf16 weight casts the graph also keeps
are counted with the plan's compute copies). Attention is a stand-in for PyTorch's `varlen_attn` (opaque
custom operators that keep what FlashAttention keeps), so that the graph is the one the GPU compiles.

On the H200 the eager count left the compiled 4B's plan at 123.0 GiB for a measured peak of 98.7 (25 % over,
so `auto` checkpointed 21 of 36 layers); the compiled count plans 102.6 GiB for that run (+4 %), 36 of 36
checkpointed plans the same as before, and `auto` now checkpoints 7."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from transformers import AutoModelForCausalLM

from learner_longtail import SHAPES
from offpolicy.learner.build import build_trainables
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.model import Precision, attention, make_tiny_model
from offpolicy.learner.plan import auto
from offpolicy.learner.plan.memory import GIB, ModelShape, compiles, estimate
from tests.unit.learner.model.test_compile_shapes import _each


@torch.library.custom_op("offpolicy_test::varlen_keep", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_q: int) -> torch.Tensor:
    return _each(q, k, v, cu.tolist())


@_attend.register_fake
def _(q, k, v, cu, max_q):
    return torch.empty_like(q)


@torch.library.custom_op("offpolicy_test::varlen_keep_backward", mutates_args=())
def _attend_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad: torch.Tensor
) -> list[torch.Tensor]:
    return [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]  # never run: graphs are read


@_attend_backward.register_fake
def _(q, k, v, out, grad):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], output)  # as FlashAttention: q, k, v, the lengths, the output


def _backward(ctx, grad):
    q, k, v, _, out = ctx.saved_tensors
    return *_attend_backward(q, k, v, out, grad), None, None


_attend.register_autograd(_backward, setup_context=_setup)


def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, is_causal=True, enable_gqa=False):
    return _attend(q, k, v, cu_q, max_q)


class _Read(Exception):
    """Raised by the reading compiler once it has the forward graph (nothing more to do)."""


def saved_bytes(layer: torch.nn.Module, rope: torch.nn.Module, tokens: int, bf16: bool) -> int:
    """Bytes of the tensors the partitioned forward graph of `layer` keeps for the backward pass, on a
    packed row of `tokens` tokens under bf16 autocast (or on bf16 weights): the rotary tables aside (the
    model computes them once for all its layers)."""
    read: dict[str, int] = {}

    def forward_graph(gm, example_inputs):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        kept = [n.meta["val"] for n in outputs[1:] if isinstance(n.meta.get("val"), torch.Tensor)]
        head_dim = rope.inv_freq.numel() * 2
        rotary = {id(t) for t in kept if t.dim() == 3 and t.shape[0] == 1 and t.shape[-1] == head_dim}
        read["bytes"] = sum(int(t.numel()) * t.element_size() for t in kept if id(t) not in rotary)
        raise _Read

    backend = aot_autograd(
        fw_compiler=forward_graph, decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(layer.forward, dynamic=True, backend=backend)
    lens = [tokens // 8] * 8
    kwargs = attention.packed_kwargs(lens, torch.device("cpu"))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.zeros(1, tokens, layer.mlp.gate_proj.in_features, dtype=dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bf16), pytest.raises(Exception) as e:
        compiled(x, position_embeddings=rope(x, pos), position_ids=pos, **kwargs)
    assert "_Read" in repr(e.value) or isinstance(e.value, _Read), e.value
    torch._dynamo.reset()
    return read["bytes"]


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(attention, "varlen_attn", varlen_attn)
    monkeypatch.setattr(attention, "VARLEN_KEYWORDS", frozenset({"scale", "is_causal", "enable_gqa"}))


@pytest.mark.parametrize("name", ["longtail-4b", "longtail-1.3b"])  # Qwen3 (q/k norms) and Llama
@pytest.mark.parametrize("bf16", [False, True], ids=["bf16_mixed", "bf16_stream"])
def test_a_compiled_layer_keeps_what_the_plan_counts(stand_in, name, bf16):
    cls, widths = SHAPES[name]
    hf = cls(**(widths | {"num_hidden_layers": 1, "vocab_size": 64}))
    hf._attn_implementation = attention.TORCH_VARLEN
    model = AutoModelForCausalLM.from_config(hf).train()
    if bf16:
        model = model.to(torch.bfloat16)
    layer, rope = model.model.layers[0], model.model.rotary_emb
    per_token = (saved_bytes(layer, rope, 8192, bf16) - saved_bytes(layer, rope, 4096, bf16)) / 4096
    shape = ModelShape.of(hf)
    stream = "bf16_pure" if bf16 else "bf16_mixed"
    # the count leaves out a few fp32 scalars per token (the norms' and attention's): 0.15 %
    assert per_token == pytest.approx(shape.layer_bytes(stream, compiled=True), rel=2e-3), per_token
    assert per_token < 0.7 * shape.layer_bytes(stream)  # the eager layer keeps over 1.4 times as much


def test_auto_checkpoints_fewer_layers_when_the_layers_are_compiled():
    """The 4B shape of the GPU benchmark against 90 % of the H200: compiled layers keep ~56 % of the eager
    bytes, so fewer layers need recomputing (each costs its forward again)."""
    cls, widths = SHAPES["longtail-4b"]
    shape, limit = ModelShape.of(cls(**widths)), int(0.9 * 139.8 * GIB)
    chosen, plans = {}, {}
    for compiled in (False, True):
        cfg = LearnerConfig(model_path="unused", compile_layers=compiled, gradient_checkpointing="auto",
                            micro_batch_tokens="auto", no_grad_micro_batch_tokens="auto")  # fmt: skip
        chosen[compiled] = auto.choose(cfg, shape, 1, False, True, limit)
        plans[compiled] = [estimate(cfg, shape, 1, False, k, True, tokens=16384).total / GIB
                           for k in (21, 36)]  # fmt: skip
    assert chosen[False].checkpointed_layers == 21 and chosen[True].checkpointed_layers == 7
    assert all(s.plan.total <= limit for s in chosen.values())
    assert chosen[True].micro_batch_tokens == chosen[False].micro_batch_tokens == 16384
    # the H200's compiled row (21 checkpointed, 16,384 tokens) peaked at 98.7 GiB
    assert plans[False][0] == pytest.approx(123.0, abs=0.05)
    assert plans[True][0] == pytest.approx(102.6, abs=0.05)
    assert plans[False][1] == plans[True][1]  # every layer checkpointed: no saved tensors to count


@pytest.mark.parametrize(
    ("setting", "cuda", "sharded", "lora", "want"),
    [
        ("auto", True, False, False, True),  # one CUDA process: where it was measured to pay
        ("auto", False, False, False, False),  # CPU: Inductor's C++ build costs minutes
        ("auto", True, True, False, False),  # FSDP on several ranks: not measured yet
        ("auto", True, False, True, False),  # LoRA: not measured yet
        (True, False, True, True, True),
        (False, True, False, False, False),
    ],
)  # fmt: skip
def test_compile_layers_auto_is_on_for_one_cuda_process_alone(setting, cuda, sharded, lora, want):
    cls, widths = SHAPES["longtail-4b"]
    shape = ModelShape.of(cls(**widths))
    # bf16_mixed: fp32 compiled layers are counted as eager ones
    lora_cfg = {"rank": 8} if lora else None
    cfg = LearnerConfig(model_path="unused", compile_layers=setting, lora=lora_cfg, precision="bf16_mixed")
    assert compiles(cfg, cuda, sharded) is want
    chosen = auto.choose(cfg, shape, 2 if sharded else 1, sharded, cuda, None)
    assert chosen.as_dict()["compile_layers"] is want  # what the log, /v1/status and the benchmark report
    # the plan follows: compiled layers keep fewer bytes (every layer kept, no checkpointing)
    eager = cfg.model_copy(update={"compile_layers": False})
    kept = [estimate(c, shape, 1, sharded, 0, cuda, tokens=16384).activations for c in (cfg, eager)]
    assert (kept[0] < kept[1]) is want


def test_the_default_config_compiles_on_cuda_and_the_cpu_learner_stays_eager(tmp_path):
    """`compile_layers` defaults to `auto`; built on CPU, the learner's layers keep their eager forward
    (and `compiled=True`, what the plan resolves on one CUDA process, wraps them)."""
    tiny = make_tiny_model(tmp_path / "m", hidden_size=64, num_heads=1, num_layers=2, intermediate_size=96)
    cfg = LearnerConfig(model_path=str(tiny), device="cpu")
    assert cfg.compile_layers == "auto"
    cpu = torch.device("cpu")
    parts, _, _ = build_trainables(cfg, cpu, Precision.resolve("fp32", cpu), False, False)
    layer = parts.model.model.layers[0]
    assert layer.forward.__func__ is type(layer).forward  # not a compiled wrapper
    parts, _, _ = build_trainables(cfg, cpu, Precision.resolve("fp32", cpu), False, False, compiled=True)
    assert getattr(parts.model.model.layers[0].forward, "__wrapped__", None) is not None
