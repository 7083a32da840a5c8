"""The learner's memory plan per GPU for 1.5B, 7B, 70B and MoE models on H100s (learner/plan/memory.py).

Not a measurement: the estimate the learner makes at start and refuses to run past, for the default
config on CUDA (bf16_mixed, packed micro-batches of 16,384 tokens, activation checkpointing on, LM-head
chunks of 4,096 tokens), with and without `fsdp.cpu_offload`. Model shapes are Llama-style configs of
Qwen2.5-1.5B, Qwen2.5-7B and Llama-3.1-70B, parameters counted on the meta device (nothing downloaded).
An H100 has 79.6 GiB; a plan may use 90 % of it. Mixture-of-experts rows: Qwen3-30B-A3B on 8 H100s and
DeepSeek-V3 on 256 and 384 (its experts 8 to a node: `ep` 8), shapes read from
deploy/models/<name>/config.json (learner/plan/shape.py): every expert's weights, gradients and AdamW
state sharded over the ranks (`experts_gib`: their part), the gathered layer's experts / `ep`, the
routed activations.

    python benchmarks/memory_plan.py [--json] [--smoke] [--lora RANK]

`--json`: one object, `{"h100_gib", "headroom", "rows": [one per model, GPU count and offload]}`.
`--smoke`: the 1.5B model only (the same estimate, CI). `--lora RANK`: the learner trains a LoRA adapter of
that rank on every linear layer (`lora.target_modules: all-linear`) of the frozen model: gradients and AdamW
only for the adapter (docs/lora.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import LlamaConfig

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.plan.memory import GIB, HEADROOM, ModelShape, estimate, expert_state

H100_GIB = 79.6


def llama(h: int, i: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
    )  # fmt: skip


MODELS = {
    "1.5B": llama(1536, 8960, 28, 12, 2, 151936, tied=True),
    "7B": llama(3584, 18944, 28, 28, 4, 152064, tied=False),
    "70B": llama(8192, 28672, 80, 64, 8, 128256, tied=False),
}


MOE_DIR = Path(__file__).resolve().parent.parent / "deploy" / "models"
MOE = {  # name: (config.json folder, [(GPUs, cpu_offload, ep)])
    "Qwen3-30B-A3B": ("qwen3-30b-a3b", [(8, False, 1), (8, False, 8), (8, True, 1)]),
    "DeepSeek-V3": ("deepseek-v3", [(256, False, 8), (384, False, 8)]),
}


def row(name: str, shape: ModelShape, cfg: LearnerConfig, gpus: int, ep: int = 1) -> dict:
    plan = estimate(cfg, shape, gpus, sharded=gpus > 1, checkpointing=True, cuda=True, ep=ep)
    offloaded = cfg.fsdp.cpu_offload and gpus > 1  # then in host memory, as the plan's own states
    experts = 0 if offloaded else sum(expert_state(cfg, shape, gpus, gpus > 1, cuda=True).values())
    return {
        "model": name,
        "params_b": shape.params / 1e9,
        "active_params_b": shape.active_params / 1e9,
        "lora_rank": None if cfg.lora is None else cfg.lora.rank,
        "adapter_params_m": shape.adapter / 1e6 if cfg.lora else 0.0,
        "gpus": gpus,
        "ep": ep,
        "cpu_offload": cfg.fsdp.cpu_offload,
        **{f"{k}_gib": round(v, 1) for k, v in plan.as_dict().items()},
        "experts_gib": round(experts / GIB, 1),  # the routed experts' share of weights+grads+AdamW
        "fits": plan.total <= HEADROOM * H100_GIB * GIB,
    }


def rows(models: list[str], lora_rank: int | None = None) -> list[dict]:
    out = []
    lora = None if lora_rank is None else {"rank": lora_rank}
    for name in models:
        if name in MOE:
            folder, cases = MOE[name]
            shape = ModelShape.of_dict(json.loads((MOE_DIR / folder / "config.json").read_text()))
            for gpus, offload, ep in cases:
                cfg = LearnerConfig(model_path="unused", fsdp={"cpu_offload": offload})
                out.append(row(name, shape, cfg, gpus, ep))
            continue
        for gpus, offload in ((1, False), (8, False), (8, True)):
            cfg = LearnerConfig(model_path="unused", fsdp={"cpu_offload": offload}, lora=lora)
            out.append(row(name, ModelShape.of(MODELS[name], cfg.lora), cfg, gpus))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the 1.5B model only (CI)")
    ap.add_argument("--lora", type=int, metavar="RANK", help="a LoRA adapter of this rank, the model frozen")
    args = ap.parse_args()
    models = list(MODELS) + ([] if args.lora else list(MOE))  # MoE experts: no LoRA target here
    table = rows(["1.5B"] if args.smoke else models, args.lora)
    if args.json:
        print(json.dumps({"h100_gib": H100_GIB, "headroom": HEADROOM, "rows": table}))
        return
    head = ("model", "H100s (ep)", "cpu_offload", "weights+grads+AdamW (experts')", "bf16 copies",
            "activations", "LM-head chunk",
            "total per GPU", "fits")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for r in table:
        states = r["weights_gib"] + r["gradients_gib"] + r["optimizer_gib"]
        moe = r["active_params_b"] < r["params_b"]
        cells = (
            f"{r['model']} ({r['params_b']:.1f}B"
            + (f", {r['active_params_b']:.1f}B active)" if moe else ")"),
            f"{r['gpus']}" + (f" ({r['ep']})" if moe else ""), "yes" if r["cpu_offload"] else "no",
            f"{states:.1f}" + (f" ({r['experts_gib']:.1f})" if moe else ""),
            f"{r['compute_copies_gib']:.1f}", f"{r['activations_gib']:.1f}", f"{r['lm_head_chunk_gib']:.1f}",
            f"{r['total_gib']:.1f} GiB", "✔" if r["fits"] else "✘",
        )  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
