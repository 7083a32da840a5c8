"""What one decoder layer and the LM head of a model shape cost per token, counted op by op: FLOPs and bytes.

    python benchmarks/learner_traffic.py [--shape longtail-4b|longtail-1.3b] [--tokens 1024] [--json]
                                         [--smoke]

The learner's own log-prob path (`LogProbs`, packed, the fused head, bf16 autocast over fp32 weights as
`bf16_mixed`) runs on CPU on the shape's real widths with 1 and with 2 decoder layers, under a dispatch mode
that sees every operator, backward included. Per operator: its FLOPs (matrix products, by
`torch.utils.flop_counter`) and its bytes (every tensor it reads and writes; views and allocations move
none). One layer = the 2-layer run less the 1-layer run; the head (with the embedding and the final norm) =
the 1-layer run less one layer. Three passes: `pi_old` (no grad), `train` (forward + backward) and
`train_checkpointed` (the layer recomputed in the backward).

From those counts, `estimate` gives each pass's time on a GPU as a roofline without overlap: matrix-product
FLOPs at the measured bf16 matmul rate (790 TFLOP/s on the lent H100/H200) plus every other byte at the
measured copy bandwidth (H200 4.3 TB/s, H100 3.0); attention's FLOPs are not counted (the CPU's flash
kernel has no FLOP formula), its bytes are. It is the eager model: what `compile_layers` (Inductor's fusion
of the norms, RoPE, SwiGLU and casts) can save is the elementwise and copy bytes, an upper bound. The CPU
runs the fused head's passes eagerly, each in-place step reading and writing the chunk's fp32 logits, where
CUDA compiles each pass into one kernel: the head's bytes are an upper bound too.

Figures: docs/benchmarks.md ("Bytes and FLOPs per token").
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry
from transformers import AutoModelForCausalLM

from learner_longtail import SHAPES, SMOKE, longtail_groups
from learner_profile import kind
from offpolicy.learner.batch import collate
from offpolicy.learner.model import attention  # noqa: F401  (registers sdpa_varlen)
from offpolicy.learner.model.policy import LogProbs
from offpolicy.learner.model.recompute import checkpoint_layers

NO_TRAFFIC = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
              "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
              "sym_storage_offset"}  # fmt: skip
GPUS = {"H200": (790e12, 4.3e12), "H100": (790e12, 3.0e12)}  # measured bf16 matmul FLOP/s, copy bytes/s


MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
"""Matrix products are not computed, only shaped (their outputs zeros): bf16 products run at ~0.2 GFLOP/s
on a CPU without bf16 units, and what is counted depends on shapes and dtypes alone."""


class Traffic(TorchDispatchMode):
    """FLOPs (matrix products) and bytes read and written per kind of operator (`learner_profile.kind`)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in MATMULS:
            margs, mkwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            meta = func(*margs, **mkwargs)  # the output's shape and dtype, nothing computed
            out = torch.zeros(meta.shape, dtype=meta.dtype)
        else:
            out = func(*args, **kwargs)
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        k = "attention" if "attention" in name else kind(f"aten::{name}")
        if view or name in NO_TRAFFIC or k == "other":  # `other`: views and allocations by name
            return out
        if func.overloadpacket in flop_registry:  # FlopCounterMode's formulas, called as it calls them
            self.flops[k] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.bytes[k] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def model_of(shape: str, layers: int, smoke: bool) -> torch.nn.Module:
    kind_, dims = SHAPES[shape]
    config = kind_(**(dims | SMOKE if smoke else dims) | {"num_hidden_layers": layers},
                   max_position_embeddings=16384)  # fmt: skip
    config._attn_implementation = "sdpa_varlen"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()  # fp32 masters, as bf16_mixed keeps them


def count(model: torch.nn.Module, batch, mode: str) -> Traffic:
    """One pass of `mode` (pi_old, train, train_checkpointed) of the learner's log-prob path, counted."""
    layers = model.model.layers
    checkpoint_layers(model, layers, len(layers) if mode == "train_checkpointed" else 0)
    policy = LogProbs(model, "fused")
    traffic = Traffic()
    with traffic, torch.autocast("cpu", dtype=torch.bfloat16):
        if mode == "pi_old":
            with torch.no_grad():
                policy(batch, 4096, packed=True)
        else:
            lp, _ = policy(batch, 4096, packed=True)
            lp.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return traffic


def micro_batch(vocab: int, tokens: int):
    """A packed micro-batch of long-tailed completions (lengths / 16) of about `tokens` tokens."""
    batch = collate(longtail_groups(16, 8, vocab, seed=0, scale=16), 0)
    keep = batch.attention_mask.sum(-1).cumsum(0) <= tokens  # the first rows, up to `tokens` tokens
    return batch.select(torch.nonzero(keep).flatten())


def per_token(shape: str, tokens: int, smoke: bool) -> dict:
    """Per pass and kind: FLOPs and bytes of one layer and of the head, per token (the slope between two
    micro-batch sizes) and per micro-batch (what does not grow with tokens: weight casts, weight
    gradients, optimizer-free)."""
    vocab = (SMOKE if smoke else SHAPES[shape][1])["vocab_size"]
    batches = [micro_batch(vocab, tokens // 2), micro_batch(vocab, tokens)]
    sizes = [int(b.attention_mask.sum()) for b in batches]
    models = {n: model_of(shape, n, smoke) for n in (1, 2)}
    out: dict = {"tokens": sizes}
    for mode in ("pi_old", "train", "train_checkpointed"):
        runs = {(n, i): count(models[n], b, mode) for n in (1, 2) for i, b in enumerate(batches)}
        kinds = sorted({k for t in runs.values() for k in t.bytes})
        parts: dict = {"layer": {}, "head": {}}
        for k in kinds:
            for w in ("flops", "bytes"):
                layer = [getattr(runs[2, i], w)[k] - getattr(runs[1, i], w)[k] for i in (0, 1)]
                head = [getattr(runs[1, i], w)[k] - layer[i] for i in (0, 1)]
                for part, v in (("layer", layer), ("head", head)):
                    slope = (v[1] - v[0]) / (sizes[1] - sizes[0])
                    parts[part].setdefault(k, {})[w] = slope
                    parts[part][k][f"{w}_per_micro_batch"] = v[1] - slope * sizes[1]
        out[mode] = parts
    return out


def estimate(counts: dict, layers: int, gpu: str, tokens: int) -> dict:
    """Seconds per token of each pass of a `layers`-deep model on `gpu` with micro-batches of `tokens`
    tokens (a roofline without overlap: matrix products at the measured rate, every other byte at the
    measured bandwidth), the share of it that is matrix products, and that share with the layers'
    elementwise and copy bytes fused away (Inductor's best case)."""
    rate, bandwidth = GPUS[gpu]
    out = {}
    for mode in ("pi_old", "train", "train_checkpointed"):
        layer, head = counts[mode]["layer"], counts[mode]["head"]

        def total(part: dict, w: str, keep) -> float:
            return sum(v[w] + v[f"{w}_per_micro_batch"] / tokens for k, v in part.items() if keep(k))

        mm_flops = total(layer, "flops", "matmul".__eq__) * layers + total(head, "flops", "matmul".__eq__)
        moved = total(layer, "bytes", "matmul".__ne__) * layers + total(head, "bytes", "matmul".__ne__)
        fusable = total(layer, "bytes", ("elementwise", "copy").__contains__) * layers
        t_mm, t_mem = mm_flops / rate, moved / bandwidth
        out[mode] = {
            "matmul_flops": mm_flops,
            "other_bytes": moved,
            "fusable_bytes": fusable,
            "matmul_s": t_mm,
            "memory_s": t_mem,
            "matmul_share": t_mm / (t_mm + t_mem),
            "matmul_share_fused": t_mm / (t_mm + t_mem - fusable / bandwidth),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="longtail-4b")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the larger micro-batch counted")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="the estimate's micro-batch size")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="H200")
    ap.add_argument("--smoke", action="store_true", help="the smoke widths (hidden 64), 256 tokens (CI)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    tokens = 256 if args.smoke else args.tokens
    counts = per_token(args.shape, tokens, args.smoke)
    layers = (SMOKE if args.smoke else SHAPES[args.shape][1])["num_hidden_layers"]
    out = {"shape": args.shape + ("-smoke" if args.smoke else ""), "gpu": args.gpu, "layers": layers,
           **counts, "estimate": estimate(counts, layers, args.gpu, args.micro_batch_tokens)}  # fmt: skip
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']}: micro-batches of {counts['tokens']} tokens; per token (+ per micro-batch)")
    for mode in ("pi_old", "train", "train_checkpointed"):
        for part in ("layer", "head"):
            cells = ", ".join(f"{k} {v['flops'] / 1e6:.1f} MFLOP {v['bytes'] / 1e3:.1f} kB "
                              f"(+{v['bytes_per_micro_batch'] / 1e6:.0f} MB)"
                              for k, v in counts[mode][part].items())  # fmt: skip
            print(f"  {mode:<19} {part:<5} {cells}")
        e = out["estimate"][mode]
        print(f"  {mode:<19} {args.gpu}: matmul {e['matmul_share']:.0%} of the time, "
              f"{e['matmul_share_fused']:.0%} with elementwise and copies fused away")  # fmt: skip


if __name__ == "__main__":
    main()
